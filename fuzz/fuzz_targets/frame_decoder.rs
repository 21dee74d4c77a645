//! Fuzzes the IPC frame codec (`sharedos_proto::frame`) with the four message types.
//!
//! 1. `decode` on the raw input, for each message type.
//! 2. The input as a byte stream (after a one-byte header) fed in small chunks into a growing
//!    buffer, decoding frames and consuming used bytes the way a socket reader does, stopping at
//!    the first error.
//! 3. Every message decoded is re-encoded with `frame::encode` and must decode back equal.
#![no_main]

use std::fmt::Debug;

use libfuzzer_sys::fuzz_target;
use serde::{Serialize, de::DeserializeOwned};
use sharedos_proto::frame::{self, FrameError, HEADER_BYTES};
use sharedos_proto::ipc::{BridgeEvent, BridgeRequest, ControlRequest, ControlResponse};

trait Message: Serialize + DeserializeOwned + PartialEq + Debug {}
impl<T: Serialize + DeserializeOwned + PartialEq + Debug> Message for T {}

/// Re-encodes a decoded message and checks it decodes back to the same value, using all bytes.
fn round_trip<T: Message>(message: &T) {
    let bytes = frame::encode(message).expect("a decoded message re-encodes");
    let (back, used) = frame::decode::<T>(&bytes)
        .expect("a re-encoded message decodes")
        .expect("a re-encoded frame is complete");
    assert_eq!(used, bytes.len(), "decode used the whole re-encoded frame");
    assert_eq!(&back, message, "re-encoded message decodes back equal");
}

/// One `decode` call plus the invariants that hold for any buffer.
fn decode_checked<T: Message>(buf: &[u8]) -> Result<Option<(T, usize)>, FrameError> {
    let result = frame::decode::<T>(buf);
    match (&result, frame::body_len(buf)) {
        (Ok(Some((message, used))), Ok(Some(len))) => {
            assert_eq!(*used, HEADER_BYTES + len, "used = header + claimed body");
            assert!(*used <= buf.len(), "used within the buffer");
            round_trip(message);
        }
        (Ok(Some(_)), other) => panic!("decoded a frame but body_len says {other:?}"),
        (Ok(None), Ok(Some(len))) => {
            assert!(buf.len() < HEADER_BYTES + len, "need-more with the whole frame present")
        }
        (Ok(None), Ok(None)) => assert!(buf.len() < HEADER_BYTES),
        (Ok(None), Err(e)) => panic!("need-more although body_len errs: {e}"),
        (Err(_), _) => {}
    }
    result
}

/// Feeds `stream` in `chunk`-byte pieces, decoding frames as a socket reader would.
fn stream_decode<T: Message>(stream: &[u8], chunk: usize) {
    let mut buf: Vec<u8> = Vec::new();
    for piece in stream.chunks(chunk) {
        buf.extend_from_slice(piece);
        loop {
            match decode_checked::<T>(&buf) {
                Ok(Some((_, used))) => {
                    buf.drain(..used);
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    // (a) The raw input as one buffer.
    let _ = decode_checked::<BridgeRequest>(data);
    let _ = decode_checked::<BridgeEvent>(data);
    let _ = decode_checked::<ControlRequest>(data);
    let _ = decode_checked::<ControlResponse>(data);

    // (b) The rest of the input as a stream; the first byte picks the chunk size (1..=16) and
    // the message type.
    let Some((&control, stream)) = data.split_first() else {
        return;
    };
    let chunk = usize::from(control & 0x0f) + 1;
    match (control >> 4) & 0x03 {
        0 => stream_decode::<BridgeRequest>(stream, chunk),
        1 => stream_decode::<BridgeEvent>(stream, chunk),
        2 => stream_decode::<ControlRequest>(stream, chunk),
        _ => stream_decode::<ControlResponse>(stream, chunk),
    }
});
