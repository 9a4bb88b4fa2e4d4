//! Prints every kernel the launch code can name, one per line: `kernel threads smem_bytes file`
//! (tab-separated, a header first). `kernels/sass_stats.py` reads it to show and check each
//! image's dynamic shared memory beside its registers.
//!
//!     cargo run --release -q --manifest-path native/exla_rs/Cargo.toml -p exla-rs-cuda --example launch_table

fn main() {
    println!("kernel\tthreads\tsmem\tfile");
    for k in exla_rs_cuda::every_launch() {
        println!("{}\t{}\t{}\t{}", k.kernel, k.threads, k.smem, k.file);
    }
}
