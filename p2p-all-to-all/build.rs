//! Compiles `kernels/*.cu` (the MoE all-to-all kernels) into one fatbin that `src/kernels.rs`
//! embeds (see the cuda-build crate for how nvcc is found and what happens without it).
fn main() {
    cuda_build::compile_kernels("p2p-all-to-all", "P2P_A2A");
}
