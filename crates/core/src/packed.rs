//! A compact form for what a process keeps long but seldom reads: the state of runs that
//! wait for their client (100,000 of them may wait at once, each for hours).
//!
//! Such state is JSON whose keys, and most of whose structure, are the same in every run:
//! DEFLATE primed with a dictionary of that structure (a preset dictionary, as zlib has it)
//! stores little more than what differs, the ids and the text. A waiting run of the bench
//! (`agentrt-bench --waiting`) is about 1.8 KB of JSON in the run store and 0.7 KB in the
//! event bus, packed into under 360 and under 200 bytes (their unit tests hold them to it).
//!
//! The dictionary only makes the output smaller: a packer reads what it wrote whatever the
//! data, and nothing packed leaves the process, so the dictionary may change between
//! versions.

use std::cell::RefCell;

use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};

/// DEFLATE's level: zlib's default; with a dictionary, higher levels pack a waiting run no smaller
/// (within a few bytes) and take longer.
const LEVEL: u32 = 6;
/// How the packed form starts: as given (the data did not shrink, or could not be
/// compressed), or deflated.
const STORED: u8 = 0;
const DEFLATED: u8 = 1;

thread_local! {
    /// Each thread reuses one compressor and one decompressor: their windows and tables are
    /// a few hundred kilobytes, too much to make for every value packed.
    static DEFLATE: RefCell<Option<Compress>> = const { RefCell::new(None) };
    static INFLATE: RefCell<Option<Decompress>> = const { RefCell::new(None) };
}

/// Packs byte strings of one kind: DEFLATE primed with a dictionary of what such strings
/// usually hold.
#[derive(Debug, Clone)]
pub struct Packer {
    dictionary: Box<[u8]>,
}

/// A packed value that does not unpack: not one [`Packer::pack`] made with this packer's
/// dictionary.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a packed value does not unpack: {0}")]
pub struct UnpackError(String);

impl Packer {
    /// A packer whose dictionary is `dictionary`: text like the values it packs (their
    /// keys and fixed parts; what occurs near its end is found most cheaply).
    pub fn new(dictionary: impl Into<Vec<u8>>) -> Self {
        Self {
            dictionary: dictionary.into().into_boxed_slice(),
        }
    }

    /// `data`, packed: the allocation holds exactly what it needs.
    pub fn pack(&self, data: &[u8]) -> Box<[u8]> {
        let deflated = DEFLATE.with(|slot| {
            let mut slot = slot.borrow_mut();
            let compress =
                slot.get_or_insert_with(|| Compress::new(Compression::new(LEVEL), false));
            compress.reset();
            compress.set_dictionary(&self.dictionary).ok()?;
            let mut out = Vec::with_capacity(data.len() / 2 + 64);
            out.push(DEFLATED);
            loop {
                let consumed = usize::try_from(compress.total_in()).unwrap_or(usize::MAX);
                let rest = data.get(consumed..).unwrap_or_default();
                if out.len() == out.capacity() {
                    out.reserve(out.capacity());
                }
                match compress.compress_vec(rest, &mut out, FlushCompress::Finish) {
                    Ok(Status::StreamEnd) => return Some(out),
                    Ok(Status::Ok | Status::BufError) => {}
                    Err(_) => return None,
                }
                if out.len() > data.len() {
                    // It does not shrink: kept as it is.
                    return None;
                }
            }
        });
        match deflated {
            Some(out) if out.len() <= data.len() => out.into_boxed_slice(),
            _ => {
                let mut stored = Vec::with_capacity(data.len() + 1);
                stored.push(STORED);
                stored.extend_from_slice(data);
                stored.into_boxed_slice()
            }
        }
    }

    /// What [`Packer::pack`] was given.
    pub fn unpack(&self, packed: &[u8]) -> Result<Vec<u8>, UnpackError> {
        match packed.split_first() {
            Some((&STORED, data)) => Ok(data.to_vec()),
            Some((&DEFLATED, deflated)) => INFLATE.with(|slot| {
                let mut slot = slot.borrow_mut();
                let decompress = slot.get_or_insert_with(|| Decompress::new(false));
                decompress.reset(false);
                decompress
                    .set_dictionary(&self.dictionary)
                    .map_err(|e| UnpackError(e.to_string()))?;
                let mut out = Vec::with_capacity(deflated.len() * 4 + 64);
                loop {
                    let consumed = usize::try_from(decompress.total_in()).unwrap_or(usize::MAX);
                    let rest = deflated.get(consumed..).unwrap_or_default();
                    if out.len() == out.capacity() {
                        out.reserve(out.capacity());
                    }
                    let before = (decompress.total_in(), decompress.total_out());
                    match decompress.decompress_vec(rest, &mut out, FlushDecompress::Finish) {
                        Ok(Status::StreamEnd) => return Ok(out),
                        Ok(_)
                            if (decompress.total_in(), decompress.total_out()) == before
                                && out.len() < out.capacity() =>
                        {
                            return Err(UnpackError("it ends before its end".into()));
                        }
                        Ok(_) => {}
                        Err(e) => return Err(UnpackError(e.to_string())),
                    }
                }
            }),
            _ => Err(UnpackError("it has no header".into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_come_back_as_they_were_packed() {
        let packer = Packer::new(r#"{"run_id":"","query":"","status":"RequiresAction"}"#);
        let small = br#"{"run_id":"8f86654a-55a4-4c57-878e-6dd42bdb9a69","query":"where?","status":"RequiresAction"}"#;
        let large: Vec<u8> = (0..200_000u32)
            .flat_map(|i| (i % 251).to_le_bytes())
            .collect();
        for data in [&b""[..], &b"x"[..], &small[..], &large[..]] {
            let packed = packer.pack(data);
            assert_eq!(packer.unpack(&packed).unwrap(), data);
        }
        // What the dictionary knows costs little.
        let without = Packer::new(Vec::new()).pack(small).len();
        assert!(packer.pack(small).len() + 20 < without, "{without}");
    }

    #[test]
    fn what_is_not_a_packed_value_is_an_error() {
        let packer = Packer::new("dictionary");
        let packed = packer.pack(&[7; 1000]);
        for broken in [&[][..], &[9, 1, 2][..], &packed[..packed.len() / 2]] {
            assert!(packer.unpack(broken).is_err(), "{broken:?}");
        }
    }
}
