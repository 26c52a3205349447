//! The Protobuf codec of every generated client and server.
//!
//! tonic's default codec gives each call an 8 KiB encode buffer and each decoded body an
//! 8 KiB read buffer, held as long as the call lives. A server with ten thousand open
//! `Execute` streams whose events are a few hundred bytes would hold 80 MiB of empty
//! buffer; this codec starts at 512 bytes and grows by as much as a message needs.
//!
//! A message that is not valid Protobuf is the sender's fault: tonic reports it as
//! `INTERNAL`, this codec as `INVALID_ARGUMENT`, so that a server answers a malformed
//! request with the code the gRPC status guide gives for a bad request.

use std::marker::PhantomData;

use tonic::{
    Code, Status,
    codec::{BufferSettings, Codec, DecodeBuf, Decoder},
};
use tonic_prost::{ProstDecoder, ProstEncoder};

/// Initial size and growth step of encode and decode buffers.
const BUFFER_SIZE: usize = 512;
/// Encoded bytes after which a stream yields them to the transport (tonic's default).
const YIELD_THRESHOLD: usize = 32 * 1024;

fn settings() -> BufferSettings {
    BufferSettings::new(BUFFER_SIZE, YIELD_THRESHOLD)
}

/// [`tonic_prost::ProstCodec`] with small initial buffers.
#[derive(Debug)]
pub struct LeanCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for LeanCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for LeanCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = LeanDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(settings())
    }

    fn decoder(&mut self) -> Self::Decoder {
        LeanDecoder(ProstDecoder::new(settings()))
    }
}

/// [`ProstDecoder`] that reports a message it cannot decode as `INVALID_ARGUMENT`.
#[derive(Debug)]
pub struct LeanDecoder<U>(ProstDecoder<U>);

impl<U: prost::Message + Default> Decoder for LeanDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.0.decode(src).map_err(|status| {
            if status.code() == Code::Internal {
                Status::invalid_argument(format!(
                    "the message is not valid Protobuf for this method: {}",
                    status.message()
                ))
            } else {
                status
            }
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}
