//! Build-script helper shared by the crates that embed CUDA kernels (cuda-lib, p2p-all-to-all):
//! compiles the calling crate's `kernels/*.cu` into one fatbin for `include_bytes!`.
//!
//! nvcc is looked up, first hit wins:
//! 1. `$NVCC` (when set, only this one is tried),
//! 2. `$CUDA_HOME/bin/nvcc`,
//! 3. `nvcc` on `$PATH`,
//! 4. the PyPI layout of the `nvidia-cuda-nvcc` wheel in `$PYTHON` (default `python3`):
//!    `<site-packages>/nvidia/cu13/bin/nvcc`, headers from `<site-packages>/nvidia/cu13/include`,
//! 5. the private toolchain that `scripts/setup.sh` installs:
//!    `${XDG_CACHE_HOME:-$HOME/.cache}/fabric-lib/nvcc-13.0.*/nvidia/cu13/bin/nvcc`.
//!
//! Without nvcc the build still succeeds: it sets `cfg(cuda_kernels_missing)` and prints a cargo
//! warning; the crate then reports "kernels unavailable" when a kernel is needed.
//! The fatbin's path and the built architectures reach the crate as the compile-time variables
//! `<PREFIX>_FATBIN` and `<PREFIX>_KERNEL_ARCHS`, which `cuda_lib::embed_kernels!` reads.
//! `FABRIC_LIB_REQUIRE_KERNELS=1` turns a missing nvcc into a build error (for release wheels).
use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
};

/// The CUDA architectures, in one place. `(sm, virtual arch nvcc must list to build it)`:
/// machine code for each whose virtual arch this nvcc knows.
const ARCHS: &[(&str, &str)] = &[("sm_90a", "compute_90"), ("sm_100a", "compute_100")];
/// PTX embedded for forward compatibility (JIT-compiled by newer drivers for newer GPUs).
const PTX_ARCH: &str = "compute_90";
/// The nvcc release the kernels are written and tested against.
const NVCC_RELEASE: &str = "13.0";

const ENV_VARS: &[&str] = &[
    "NVCC",
    "CUDA_HOME",
    "PATH",
    "PYTHON",
    "PYTHONPATH",
    "HOME",
    "XDG_CACHE_HOME",
    "FABRIC_LIB_REQUIRE_KERNELS",
    // Read by nvcc itself; declared so that changing them rebuilds the kernels.
    "NVCC_PREPEND_FLAGS",
    "NVCC_APPEND_FLAGS",
    "NVCC_CCBIN",
];

struct Nvcc {
    path: PathBuf,
    source: &'static str,
    include_dirs: Vec<PathBuf>,
}

/// Compiles `$CARGO_MANIFEST_DIR/kernels/*.cu`; call it from a build script. `label` names the
/// crate in messages, `env_prefix` the compile-time variables it sets.
pub fn compile_kernels(label: &str, env_prefix: &str) {
    let stem = format!("{}_kernels", env_prefix.to_lowercase());
    for var in ENV_VARS {
        println!("cargo::rerun-if-env-changed={var}");
    }
    println!("cargo::rustc-check-cfg=cfg(cuda_kernels_missing)");
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let kernel_dir = manifest.join("kernels");
    println!("cargo::rerun-if-changed={}", kernel_dir.display());
    let mut sources: Vec<PathBuf> = std::fs::read_dir(&kernel_dir)
        .unwrap_or_else(|e| panic!("{label}: reading {}: {e}", kernel_dir.display()))
        .map(|e| e.expect("readable kernels dir").path())
        .filter(|p| matches!(p.extension().and_then(|e| e.to_str()), Some("cu" | "cuh")))
        .collect();
    sources.sort();
    for src in &sources {
        println!("cargo::rerun-if-changed={}", src.display());
    }

    let Some(nvcc) = find_nvcc() else {
        if env::var("FABRIC_LIB_REQUIRE_KERNELS").as_deref() == Ok("1") {
            panic!("FABRIC_LIB_REQUIRE_KERNELS=1 but no nvcc was found; install nvcc {NVCC_RELEASE}.x (scripts/setup.sh does) or set NVCC");
        }
        println!(
            "cargo::warning={label}: nvcc not found (NVCC, CUDA_HOME, PATH, PyPI nvidia-cuda-nvcc, setup.sh cache): \
             CUDA kernels are not built; install nvcc {NVCC_RELEASE}.x (scripts/setup.sh does) and rebuild"
        );
        println!("cargo::rustc-cfg=cuda_kernels_missing");
        println!("cargo::rustc-env={env_prefix}_KERNEL_ARCHS=");
        return;
    };

    // Shown by `cargo build -vv` (and kept in the build script's output file).
    println!("{label}: using nvcc {} (found via {})", nvcc.path.display(), nvcc.source);
    let version = run(&nvcc.path, &["--version"]).unwrap_or_default();
    if !version.contains(&format!("release {NVCC_RELEASE},")) {
        println!(
            "cargo::warning={label}: {} ({}) is not nvcc {NVCC_RELEASE}.x; kernels built by it may not load on CUDA {NVCC_RELEASE} drivers",
            nvcc.path.display(),
            nvcc.source
        );
    }
    let known_archs = run(&nvcc.path, &["--list-gpu-arch"]).unwrap_or_default();
    let mut gencode: Vec<String> = Vec::new();
    let mut built: Vec<&str> = Vec::new();
    for (sm, needs) in ARCHS {
        if known_archs.split_whitespace().any(|a| a == *needs) {
            let virt = sm.replace("sm_", "compute_");
            gencode.push(format!("-gencode=arch={virt},code={sm}"));
            built.push(sm);
        }
    }
    assert!(!built.is_empty(), "{} supports none of {ARCHS:?}", nvcc.path.display());
    gencode.push(format!("-gencode=arch={PTX_ARCH},code={PTX_ARCH}"));

    // One translation unit including every kernel file gives one fatbin.
    let unit = out.join(format!("{stem}.cu"));
    let body: String = sources
        .iter()
        .filter(|p| p.extension().and_then(|e| e.to_str()) == Some("cu"))
        .map(|p| format!("#include \"{}\"\n", p.display()))
        .collect();
    std::fs::write(&unit, body).expect("writing the kernel unit");
    let fatbin = out.join(format!("{stem}.fatbin"));
    let mut cmd = Command::new(&nvcc.path);
    cmd.arg("-fatbin").args(["-O3", "-std=c++17", "--threads", "0"]).args(&gencode);
    cmd.arg(format!("-I{}", kernel_dir.display()));
    for dir in &nvcc.include_dirs {
        cmd.arg(format!("-I{}", dir.display()));
    }
    cmd.arg("-o").arg(&fatbin).arg(&unit);
    let output = cmd.output().unwrap_or_else(|e| panic!("running {}: {e}", nvcc.path.display()));
    if !output.status.success() {
        panic!(
            "{label}: nvcc failed compiling {} ({:?}):\n{}{}",
            kernel_dir.display(),
            cmd,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    println!("cargo::rustc-env={env_prefix}_FATBIN={}", fatbin.display());
    println!("cargo::rustc-env={env_prefix}_KERNEL_ARCHS={}", built.join(","));
}

fn run(program: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new(program).args(args).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn works(path: &Path) -> bool {
    path.is_file() && run(path, &["--version"]).is_some()
}

fn nonempty_env(name: &str) -> Option<String> {
    env::var(name).ok().filter(|v| !v.is_empty())
}

fn find_nvcc() -> Option<Nvcc> {
    let plain = |path: PathBuf, source| Nvcc { path, source, include_dirs: Vec::new() };
    if let Some(explicit) = nonempty_env("NVCC") {
        let path = PathBuf::from(explicit);
        if works(&path) {
            return Some(plain(path, "NVCC"));
        }
        println!("cargo::warning=NVCC={} does not run; not looking elsewhere", path.display());
        return None;
    }
    if let Some(home) = nonempty_env("CUDA_HOME") {
        let path = Path::new(&home).join("bin").join("nvcc");
        if works(&path) {
            return Some(plain(path, "CUDA_HOME"));
        }
    }
    if let Some(paths) = env::var_os("PATH") {
        for dir in env::split_paths(&paths) {
            let path = dir.join("nvcc");
            if works(&path) {
                return Some(plain(path, "PATH"));
            }
        }
    }
    if let Some(found) = pypi_nvcc() {
        return Some(found);
    }
    setup_cache_nvcc()
}

/// `nvidia-cuda-nvcc` and friends from PyPI install into the `nvidia` namespace package.
fn pypi_nvcc() -> Option<Nvcc> {
    let python = nonempty_env("PYTHON").unwrap_or_else(|| "python3".into());
    let script = "import nvidia, os\nfor p in nvidia.__path__: print(os.path.dirname(p))";
    let out = Command::new(python).args(["-c", script]).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let sites: Vec<PathBuf> = String::from_utf8_lossy(&out.stdout).lines().map(PathBuf::from).collect();
    let site = sites.iter().find(|s| works(&s.join("nvidia/cu13/bin/nvcc")))?;
    // Headers (cuda-crt, cuda-runtime, cccl wheels) next to nvcc first, then other site dirs.
    let mut include_dirs = vec![site.join("nvidia/cu13/include")];
    include_dirs.extend(sites.iter().filter(|s| *s != site).map(|s| s.join("nvidia/cu13/include")));
    include_dirs.retain(|d| d.is_dir());
    Some(Nvcc { path: site.join("nvidia/cu13/bin/nvcc"), source: "PyPI nvidia-cuda-nvcc", include_dirs })
}

/// The toolchain `scripts/setup.sh` installs when nothing else provides nvcc.
fn setup_cache_nvcc() -> Option<Nvcc> {
    let cache = nonempty_env("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| nonempty_env("HOME").map(|h| Path::new(&h).join(".cache")))?;
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(cache.join("fabric-lib"))
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(&format!("nvcc-{NVCC_RELEASE}.")))
        })
        .collect();
    dirs.sort();
    let root = dirs.pop()?.join("nvidia/cu13");
    let path = root.join("bin/nvcc");
    works(&path).then(|| Nvcc { path, source: "scripts/setup.sh cache", include_dirs: vec![root.join("include")] })
}
