//! The checks that paged reads and writes share: page lists that match, and every page inside
//! its region, all before anything is posted.
use crate::descriptor::check_range;
use crate::error::{FabricError, Result};

/// Refuses page lists of different lengths, an empty one and a zero page length (`what`, "read"
/// or "write", names the request in the message).
pub(super) fn check_page_lists(what: &str, page_len: u64, src_pages: &[u32], dst_pages: &[u32]) -> Result<()> {
    if src_pages.len() != dst_pages.len() {
        return Err(FabricError::InvalidArgument(format!(
            "{} source pages but {} destination pages",
            src_pages.len(),
            dst_pages.len()
        )));
    }
    if src_pages.is_empty() {
        return Err(FabricError::InvalidArgument(format!("paged {what} with an empty page list")));
    }
    if page_len == 0 {
        return Err(FabricError::InvalidArgument("page length must be positive".into()));
    }
    Ok(())
}

/// Checks that the highest of `pages` (non-empty; page `p` starts at `p * stride + offset`) fits
/// in a region of `region_len` bytes; the error names that page and its position in the list.
pub(super) fn check_page_range(
    side: &str,
    pages: &[u32],
    stride: u64,
    offset: u64,
    page_len: u64,
    region_len: u64,
) -> Result<()> {
    let (i, max) = pages.iter().enumerate().max_by_key(|(_, p)| **p).expect("non-empty");
    let start = u64::from(*max)
        .checked_mul(stride)
        .and_then(|s| s.checked_add(offset))
        .ok_or_else(|| FabricError::InvalidArgument(format!("{side} page {max} overflows")))?;
    check_range(side, region_len, start, page_len)
        .map_err(|e| FabricError::InvalidArgument(format!("{side} page index {max} (position {i}): {e}")))
}
