//! The IPC frame codec: a 4-byte big-endian length, then that many bytes of UTF-8 JSON.
//!
//! Pure functions over byte buffers: no IO here. The decoder never trusts the length prefix for
//! allocation: it checks the claimed length against [`MAX_FRAME_BYTES`] before anything else and
//! only ever parses bytes that are already in the caller's buffer. Truncated input is "need more"
//! (`Ok(None)`), oversized or malformed input is an error; nothing here panics.

use serde::{Serialize, de::DeserializeOwned};

/// Bytes of the length prefix.
pub const HEADER_BYTES: usize = 4;
/// Largest frame body accepted or produced. Tool output is bounded well below this (the broker's
/// own limits), so a frame over it is a protocol violation, not a big answer.
pub const MAX_FRAME_BYTES: usize = 8 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {len} bytes exceeds the {max}-byte limit")]
    Oversized { len: usize, max: usize },
    #[error("frame has an empty body")]
    Empty,
    #[error("frame body is not a valid message: {0}")]
    Malformed(String),
    #[error("message could not be encoded: {0}")]
    Encode(String),
}

/// Bytes reserved for a frame before it is written: a `files.read` call or answer fits.
const FRAME_CAPACITY: usize = 512;

/// Encodes one message as a frame.
pub fn encode<T: Serialize>(message: &T) -> Result<Vec<u8>, FrameError> {
    // Room for a typical call or answer up front (an empty Vec reallocates as it doubles).
    let mut out = Vec::with_capacity(FRAME_CAPACITY);
    out.resize(HEADER_BYTES, 0);
    serde_json::to_writer(&mut out, message).map_err(|e| FrameError::Encode(e.to_string()))?;
    let len = out.len() - HEADER_BYTES;
    if len > MAX_FRAME_BYTES {
        return Err(FrameError::Oversized {
            len,
            max: MAX_FRAME_BYTES,
        });
    }
    let prefix = u32::try_from(len).map_err(|e| FrameError::Encode(e.to_string()))?;
    out[..HEADER_BYTES].copy_from_slice(&prefix.to_be_bytes());
    Ok(out)
}

/// The body length a buffer's header claims, once the header is complete. Errors as soon as the
/// claim is over the limit, so a reader can stop before reading (or allocating) the body.
pub fn body_len(buf: &[u8]) -> Result<Option<usize>, FrameError> {
    let Some(header) = buf.get(..HEADER_BYTES) else {
        return Ok(None);
    };
    let mut bytes = [0u8; HEADER_BYTES];
    bytes.copy_from_slice(header);
    let len = u32::from_be_bytes(bytes) as usize;
    if len > MAX_FRAME_BYTES {
        return Err(FrameError::Oversized {
            len,
            max: MAX_FRAME_BYTES,
        });
    }
    if len == 0 {
        return Err(FrameError::Empty);
    }
    Ok(Some(len))
}

/// Decodes the first frame of `buf`: `Ok(None)` when more bytes are needed, else the message and
/// how many bytes it used.
pub fn decode<T: DeserializeOwned>(buf: &[u8]) -> Result<Option<(T, usize)>, FrameError> {
    let Some(len) = body_len(buf)? else {
        return Ok(None);
    };
    let Some(body) = buf.get(HEADER_BYTES..HEADER_BYTES + len) else {
        return Ok(None);
    };
    let message = serde_json::from_slice(body).map_err(|e| FrameError::Malformed(e.to_string()))?;
    Ok(Some((message, HEADER_BYTES + len)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ipc::{BridgeRequest, PROTOCOL_VERSION, TurnToken};
    use proptest::prelude::*;

    #[test]
    fn round_trip() {
        let msg = BridgeRequest::Hello {
            protocol: PROTOCOL_VERSION,
            token: TurnToken::new("abc".into()),
            client: Default::default(),
        };
        let bytes = encode(&msg).expect("encode");
        let (back, used): (BridgeRequest, usize) = decode(&bytes).expect("decode").expect("whole");
        assert_eq!(used, bytes.len());
        assert_eq!(back, msg);
        for cut in 0..bytes.len() {
            assert!(
                decode::<BridgeRequest>(&bytes[..cut])
                    .expect("prefix")
                    .is_none()
            );
        }
    }

    #[test]
    fn claims_of_4_gib_are_refused_from_the_header() {
        let buf = [0xff, 0xff, 0xff, 0xff, b'{'];
        assert!(matches!(
            decode::<serde_json::Value>(&buf),
            Err(FrameError::Oversized { .. })
        ));
    }

    #[test]
    fn garbage_is_an_error() {
        let mut buf = 3u32.to_be_bytes().to_vec();
        buf.extend_from_slice(b"{x}");
        assert!(matches!(
            decode::<BridgeRequest>(&buf),
            Err(FrameError::Malformed(_))
        ));
        assert!(matches!(
            decode::<BridgeRequest>(&[0, 0, 0, 0]),
            Err(FrameError::Empty)
        ));
    }

    /// Regression input found by `fuzz/fuzz_targets/frame_decoder.rs`: a welcome frame whose
    /// tool has `"metadata":{}` did not survive decode → encode → decode.
    #[test]
    fn fuzz_regression_empty_metadata_welcome() {
        let hex = "000000627b2274797065223a2277656c636f6d65222c2270726f746f636f6c223a312c227475726e223a2274222c22636174616c6f675f68617368223a2268222c22746f6f6c73223a5b7b226e616d65223a2261222c226d65746164617461223a7b7d7d5d7d";
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
            .collect();
        let (first, used): (crate::ipc::BridgeEvent, usize) =
            decode(&bytes).expect("decode").expect("whole");
        assert_eq!(used, bytes.len());
        let again = encode(&first).expect("encode");
        let (second, _): (crate::ipc::BridgeEvent, usize) =
            decode(&again).expect("decode").expect("whole");
        assert_eq!(first, second);
    }

    proptest! {
        #[test]
        fn never_panics(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode::<BridgeRequest>(&bytes);
            let _ = decode::<crate::ipc::ControlRequest>(&bytes);
        }
    }
}
