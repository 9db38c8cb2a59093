//! Compiles `kernels/*.cu` into one fatbin that `src/kernels.rs` embeds (see the cuda-build crate
//! for how nvcc is found and what happens without it).
fn main() {
    cuda_build::compile_kernels("cuda-lib", "CUDA_LIB");
}
