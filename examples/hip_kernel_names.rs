//! Prints every kernel the HIP backend can launch, one `<file stem> <kernel> <arguments>` per
//! line (arguments: `P` a pointer, `4`/`8` a value of that many bytes), for
//! `ci/hip-compile-check.sh` to compare with the code objects' metadata.
fn main() {
    for k in smallseq::backend::gpu::hip::kernels() {
        println!("{} {} {}", k.stem, k.name, k.args);
    }
}
