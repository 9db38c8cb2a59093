//! Checks a peer's raw endpoint name against the provider's address format before libfabric
//! sees it. Endpoint bytes come from peers (inside an `EngineAddress` or a descriptor), and a
//! provider trusts what `fi_av_insert` gets: an empty or unterminated `shm` name, or a socket
//! address of the wrong family or length, has crashed processes or left the address vector in a
//! state where later peers failed.
use libfabric_sys as sys;

use crate::error::{FabricError, Result};

/// Longest string address accepted (libfabric's shm names are far shorter).
const MAX_STR_ADDRESS: usize = 256;
const SOCKADDR_IN_LEN: usize = 16;
const SOCKADDR_IN6_LEN: usize = 28;

fn family(bytes: &[u8]) -> i32 {
    i32::from(u16::from_ne_bytes([bytes[0], bytes[1]]))
}

fn check_sockaddr_in(bytes: &[u8]) -> std::result::Result<(), String> {
    if bytes.len() != SOCKADDR_IN_LEN || family(bytes) != libc::AF_INET {
        return Err(format!("not an IPv4 socket address ({} bytes)", bytes.len()));
    }
    Ok(())
}

fn check_sockaddr_in6(bytes: &[u8]) -> std::result::Result<(), String> {
    if bytes.len() != SOCKADDR_IN6_LEN || family(bytes) != libc::AF_INET6 {
        return Err(format!("not an IPv6 socket address ({} bytes)", bytes.len()));
    }
    Ok(())
}

fn check_string(bytes: &[u8]) -> std::result::Result<(), String> {
    let Some(nul) = bytes.iter().position(|&b| b == 0) else {
        return Err("string address is not NUL-terminated".into());
    };
    if nul == 0 || bytes.len() > MAX_STR_ADDRESS {
        return Err(format!("string address of {nul} characters ({} bytes)", bytes.len()));
    }
    if !bytes[..nul].iter().all(|b| b.is_ascii_graphic()) || bytes[nul..].iter().any(|&b| b != 0) {
        return Err("string address has non-printable characters".into());
    }
    Ok(())
}

/// Accepts `bytes` only if it has the shape of an address of `format`; `own` is this
/// endpoint's own name, the reference for formats without a fixed layout.
pub fn check_endpoint(format: u32, own: &[u8], bytes: &[u8]) -> Result<()> {
    let checked = if bytes.len() < 2 {
        Err(format!("{} bytes", bytes.len()))
    } else {
        match format {
            sys::FI_SOCKADDR_IN => check_sockaddr_in(bytes),
            sys::FI_SOCKADDR_IN6 => check_sockaddr_in6(bytes),
            sys::FI_SOCKADDR => check_sockaddr_in(bytes).or_else(|_| check_sockaddr_in6(bytes)),
            sys::FI_ADDR_STR => check_string(bytes),
            // Binary formats of hardware providers (efa, verbs): fixed length, as our own.
            _ if bytes.len() == own.len() => Ok(()),
            _ => Err(format!("{} bytes where this provider's addresses have {}", bytes.len(), own.len())),
        }
    };
    checked.map_err(|why| FabricError::InvalidDescriptor(format!("peer endpoint address rejected: {why}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sockaddr_in(port: u16) -> Vec<u8> {
        let mut b = vec![0u8; SOCKADDR_IN_LEN];
        b[..2].copy_from_slice(&(libc::AF_INET as u16).to_ne_bytes());
        b[2..4].copy_from_slice(&port.to_be_bytes());
        b[4..8].copy_from_slice(&[127, 0, 0, 1]);
        b
    }

    #[test]
    fn socket_addresses_need_their_family_and_length() {
        let own = sockaddr_in(1);
        assert!(check_endpoint(sys::FI_SOCKADDR_IN, &own, &sockaddr_in(4000)).is_ok());
        assert!(check_endpoint(sys::FI_SOCKADDR_IN, &own, &[]).is_err());
        assert!(check_endpoint(sys::FI_SOCKADDR_IN, &own, &sockaddr_in(1)[..15]).is_err());
        let mut wrong_family = sockaddr_in(1);
        wrong_family[0] ^= 0x40;
        assert!(check_endpoint(sys::FI_SOCKADDR_IN, &own, &wrong_family).is_err());
        let mut v6 = vec![0u8; SOCKADDR_IN6_LEN];
        v6[..2].copy_from_slice(&(libc::AF_INET6 as u16).to_ne_bytes());
        assert!(check_endpoint(sys::FI_SOCKADDR, &own, &v6).is_ok());
        assert!(check_endpoint(sys::FI_SOCKADDR_IN, &own, &v6).is_err());
    }

    #[test]
    fn string_addresses_must_be_terminated_and_printable() {
        let own = b"fabric-lib-1\0".to_vec();
        assert!(check_endpoint(sys::FI_ADDR_STR, &own, b"fabric-lib-2\0").is_ok());
        assert!(check_endpoint(sys::FI_ADDR_STR, &own, b"fabric-lib-2\0\0").is_ok());
        for bad in [&b""[..], b"\0", b"\0\0", b"no-nul", b"a\x01b\0", b"ab\0c\0"] {
            assert!(check_endpoint(sys::FI_ADDR_STR, &own, bad).is_err(), "{bad:?}");
        }
        assert!(check_endpoint(sys::FI_ADDR_STR, &own, &[b'a'; 300]).is_err());
    }

    #[test]
    fn other_formats_must_match_our_length() {
        let own = vec![7u8; 32];
        assert!(check_endpoint(sys::FI_ADDR_EFA, &own, &[1u8; 32]).is_ok());
        assert!(check_endpoint(sys::FI_ADDR_EFA, &own, &[1u8; 31]).is_err());
    }
}
