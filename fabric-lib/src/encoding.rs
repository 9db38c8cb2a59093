//! Versioned, length-checked byte encoding shared by addresses and descriptors.
//!
//! Layout: 4-byte magic, 2-byte little-endian version, 4-byte little-endian payload length,
//! postcard payload. Anything else (short input, wrong magic or version, trailing bytes, a payload
//! that does not decode) is rejected with [`FabricError::InvalidDescriptor`].
use serde::{de::DeserializeOwned, Serialize};

use crate::error::{FabricError, Result};

/// Bumped whenever an encoded type changes shape.
/// 2: addresses carry the owner's pid and process id, descriptors the same-host CUDA IPC data.
pub const ENCODING_VERSION: u16 = 2;
const HEADER_LEN: usize = 10;

pub(crate) fn encode_versioned<T: Serialize>(magic: [u8; 4], value: &T) -> Vec<u8> {
    let payload = postcard::to_stdvec(value).expect("postcard encoding of plain data cannot fail");
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&magic);
    out.extend_from_slice(&ENCODING_VERSION.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&payload);
    out
}

pub(crate) fn decode_versioned<T: DeserializeOwned>(magic: [u8; 4], bytes: &[u8], what: &str) -> Result<T> {
    let bad = |why: String| FabricError::InvalidDescriptor(format!("{what}: {why}"));
    if bytes.len() < HEADER_LEN {
        return Err(bad(format!("{} bytes is shorter than the {HEADER_LEN}-byte header", bytes.len())));
    }
    if bytes[..4] != magic {
        return Err(bad("wrong magic (not produced by fabric-lib, or another kind of object)".into()));
    }
    let version = u16::from_le_bytes([bytes[4], bytes[5]]);
    if version != ENCODING_VERSION {
        return Err(bad(format!("encoding version {version}, this build reads {ENCODING_VERSION}")));
    }
    let len = u32::from_le_bytes([bytes[6], bytes[7], bytes[8], bytes[9]]) as usize;
    let payload = &bytes[HEADER_LEN..];
    if payload.len() != len {
        return Err(bad(format!("header says {len} payload bytes, got {}", payload.len())));
    }
    let (value, rest) = postcard::take_from_bytes::<T>(payload).map_err(|e| bad(format!("corrupt payload: {e}")))?;
    if !rest.is_empty() {
        return Err(bad(format!("{} trailing bytes after the payload", rest.len())));
    }
    Ok(value)
}
