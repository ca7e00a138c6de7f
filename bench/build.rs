fn main() {
    println!("cargo:rerun-if-changed=native/baseline.c");
    cc::Build::new()
        .file("native/baseline.c")
        .opt_level(2)
        .warnings(true)
        .compile("cuda_multimem_baseline");
}
