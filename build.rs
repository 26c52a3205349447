//! Compiles `proto/agent/v1/*.proto` with protox (pure Rust, no system `protoc`) and
//! generates the prost messages and tonic clients and servers from the descriptors.

use std::{env, fs, path::PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_dir = PathBuf::from("proto");
    let deps_dir = PathBuf::from("proto-deps");
    println!("cargo:rerun-if-changed={}", proto_dir.display());
    println!("cargo:rerun-if-changed={}", deps_dir.display());

    let mut files: Vec<PathBuf> = fs::read_dir(proto_dir.join("agent/v1"))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "proto"))
        .collect();
    files.sort();

    // Source info keeps the comments, so that reflection clients (grpcurl describe) show
    // the documentation; imports make the set self-contained for reflection.
    let fds = protox::compile(&files, [&proto_dir])?;

    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    fs::write(
        out_dir.join("agent_v1_descriptor.bin"),
        prost::Message::encode_to_vec(&fds),
    )?;

    // The standard error details our statuses carry, for reflection clients only.
    let details = protox::compile(
        [deps_dir.join("google/rpc/error_details.proto")],
        [&deps_dir],
    )?;
    fs::write(
        out_dir.join("error_details_descriptor.bin"),
        prost::Message::encode_to_vec(&details),
    )?;

    tonic_prost_build::configure()
        .emit_rerun_if_changed(false)
        .codec_path("crate::codec::LeanCodec")
        .compile_fds(fds)?;
    Ok(())
}
