//! Generates bindings for the installed libfabric and compiles the shim for its inline calls.
use std::{env, path::PathBuf};

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-changed=shim.h");
    println!("cargo:rerun-if-changed=shim.c");
    println!("cargo:rerun-if-env-changed=LIBFABRIC_INCLUDE_DIR");

    // pkg-config emits the link flags; an explicit include dir wins for non-standard installs.
    let mut include_dirs: Vec<PathBuf> = match pkg_config::Config::new().probe("libfabric") {
        Ok(lib) => lib.include_paths,
        Err(_) => {
            println!("cargo:rustc-link-lib=fabric");
            Vec::new()
        }
    };
    if let Ok(dir) = env::var("LIBFABRIC_INCLUDE_DIR") {
        include_dirs.insert(0, PathBuf::from(dir));
    }

    let mut shim = cc::Build::new();
    shim.file("shim.c").warnings(true).flag_if_supported("-O2");
    for dir in &include_dirs {
        shim.include(dir);
    }
    shim.compile("fabric_shim");

    let mut builder = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_function("fi_getinfo|fi_freeinfo|fi_dupinfo|fi_strerror|fi_tostr|shim_.*")
        .allowlist_type("fi_.*|fid_.*|fid")
        .allowlist_var("FI_.*|FI_E.*|SHIM_.*")
        .derive_default(true)
        .layout_tests(false)
        .prepend_enum_name(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for dir in &include_dirs {
        builder = builder.clang_arg(format!("-I{}", dir.display()));
    }
    let bindings = builder.generate().expect("bindgen failed on libfabric headers (is libfabric-dev installed?)");
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR is set by cargo"));
    bindings.write_to_file(out.join("bindings.rs")).expect("writing bindings.rs");
}
