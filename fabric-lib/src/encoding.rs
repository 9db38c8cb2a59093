//! Versioned, length-checked byte encoding shared by addresses and descriptors.
//!
//! Layout: 4-byte magic, 2-byte little-endian version, 4-byte little-endian payload length,
//! postcard payload, 4-byte little-endian CRC-32 of everything before it. Anything else (short
//! input, wrong magic or version, a checksum mismatch, trailing bytes, a payload that does not
//! decode) is rejected with [`FabricError::InvalidDescriptor`]. The checksum catches corruption
//! in transit or storage: a flipped bit must not decode into a different, valid descriptor.
use serde::{de::DeserializeOwned, Serialize};

use crate::error::{FabricError, Result};

/// Bumped whenever an encoded type changes shape.
/// 2: addresses carry the owner's pid and process id, descriptors the same-host CUDA IPC data.
/// 3: addresses carry the receiver's max_message_size; a CRC-32 of the bytes before it ends them.
/// 4: writes carry the writer's epoch tag above the immediate in their remote CQ data, and
///    re-admission is a handshake of control messages (`epoch`).
/// 5: descriptors say whether peers may read the region.
/// 6: addresses carry the engine's same-host immediate inbox.
/// 7: GPU descriptors carry the owner's landing area for staged transfers, and control
///    messages carry the staging protocol (requests for slots, chunk announcements, credits).
pub const ENCODING_VERSION: u16 = 7;
const HEADER_LEN: usize = 10;
const CHECKSUM_LEN: usize = 4;

pub(crate) fn encode_versioned<T: Serialize>(magic: [u8; 4], value: &T) -> Vec<u8> {
    let payload = postcard::to_stdvec(value).expect("postcard encoding of plain data cannot fail");
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&magic);
    out.extend_from_slice(&ENCODING_VERSION.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&payload);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

pub(crate) fn decode_versioned<T: DeserializeOwned>(magic: [u8; 4], bytes: &[u8], what: &str) -> Result<T> {
    let bad = |why: String| FabricError::InvalidDescriptor(format!("{what}: {why}"));
    if bytes.len() < HEADER_LEN + CHECKSUM_LEN {
        return Err(bad(format!(
            "{} bytes is shorter than the {}-byte header and checksum",
            bytes.len(),
            HEADER_LEN + CHECKSUM_LEN
        )));
    }
    if bytes[..4] != magic {
        return Err(bad("wrong magic (not produced by fabric-lib, or another kind of object)".into()));
    }
    let version = u16::from_le_bytes([bytes[4], bytes[5]]);
    if version != ENCODING_VERSION {
        return Err(bad(format!("encoding version {version}, this build reads {ENCODING_VERSION}")));
    }
    let (body, crc) = bytes.split_at(bytes.len() - CHECKSUM_LEN);
    if crc32fast::hash(body).to_le_bytes() != crc {
        return Err(bad("checksum mismatch (corrupted or truncated bytes)".into()));
    }
    let len = u32::from_le_bytes([bytes[6], bytes[7], bytes[8], bytes[9]]) as usize;
    let payload = &body[HEADER_LEN..];
    if payload.len() != len {
        return Err(bad(format!("header says {len} payload bytes, got {}", payload.len())));
    }
    let (value, rest) = postcard::take_from_bytes::<T>(payload).map_err(|e| bad(format!("corrupt payload: {e}")))?;
    if !rest.is_empty() {
        return Err(bad(format!("{} trailing bytes after the payload", rest.len())));
    }
    Ok(value)
}
