//! Prints every kernel the HIP backend can launch, one `<file stem> <kernel>` per line, for
//! `ci/hip-compile-check.sh` to look up in the code objects.
fn main() {
    for (stem, name) in smallseq::backend::hip::kernel_names() {
        println!("{stem} {name}");
    }
}
