//! The shim declares libfabric ≥ 1.20 items by hand (`struct fi_mr_dmabuf`, the 2.x
//! `struct fi_mr_attr`, `FI_MR_DMABUF`); compiled against headers that have them, its static
//! assertions compare every field offset and size. This test compiles it against the CUDA-enabled
//! libfabric that `scripts/build_libfabric.sh` installs (`.libfabric-cuda/`, or the prefix in
//! `LIBFABRIC_PREFIX`), and says so when there is none.
use std::path::{Path, PathBuf};
use std::process::Command;

fn newer_prefix() -> Option<PathBuf> {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let candidates = std::env::var_os("LIBFABRIC_PREFIX")
        .map(PathBuf::from)
        .into_iter()
        .chain(std::iter::once(crate_dir.join("../../.libfabric-cuda")));
    candidates.into_iter().find(|p| p.join("include/rdma/fi_domain.h").exists())
}

#[test]
fn shim_layouts_match_newer_headers() {
    let Some(prefix) = newer_prefix() else {
        eprintln!("no libfabric >= 1.20 headers (scripts/build_libfabric.sh installs them): not checked");
        return;
    };
    let header = std::fs::read_to_string(prefix.join("include/rdma/fi_domain.h")).unwrap();
    assert!(header.contains("struct fi_mr_dmabuf"), "{} predates DMA-BUF", prefix.display());
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("cc")
        .args(["-std=gnu11", "-Wall", "-Werror", "-fsyntax-only"])
        .arg(format!("-I{}", prefix.join("include").display()))
        .arg(format!("-I{}", crate_dir.display()))
        .arg(crate_dir.join("shim.c"))
        .output()
        .expect("a C compiler (cc) runs");
    assert!(out.status.success(), "shim.c against {}:\n{}", prefix.display(), String::from_utf8_lossy(&out.stderr));
}
