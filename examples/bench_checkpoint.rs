//! Times a sharded checkpoint of a ~256 MiB state (8 f32 tensors of 4096 × 2048, each
//! split by columns over 2 ranks that save at once, one thread each) against the raw disk:
//! the same bytes written with `std::fs::write` (2 files, 2 threads), then with a
//! `sync_all` too (what the checkpoint does for every file), and read back with
//! `std::fs::read` against `load_sharded` (which checks checksums and assembles wholes).
//!
//! ```text
//! cargo run --release --example bench_checkpoint -- [dir] [runs]
//! ```
//!
//! `dir` (default: the temp directory) is where the files go; `runs` defaults to 3.

use regflow::graph::plan::TensorMeta;
use regflow::graph::{DType, HostArray, SplitMix64};
use regflow::runtime::StatePart;
use regflow::train::sharded::{load_sharded, save_sharded, save_sharded_async};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

const TENSORS: usize = 8;
const ROWS: usize = 4096;
const COLUMNS: usize = 2048;
const WORLD: usize = 2;

/// Each rank's parts: every tensor's columns `rank * COLUMNS / WORLD ..`.
fn parts() -> Vec<Vec<StatePart>> {
    let mut rng = SplitMix64::new(7);
    let half = COLUMNS / WORLD;
    (0..WORLD)
        .map(|rank| {
            (0..TENSORS)
                .map(|t| {
                    let values: Vec<f32> = (0..ROWS * half).map(|_| rng.next_normal() as f32).collect();
                    StatePart {
                        variable: format!("layer{t}.weight"),
                        meta: TensorMeta::new([ROWS, COLUMNS], DType::F32),
                        offsets: vec![0, rank * half],
                        value: HostArray::f32([ROWS, half], values).expect("values fill the part"),
                    }
                })
                .collect()
        })
        .collect()
}

fn gbps(bytes: usize, seconds: f64) -> f64 {
    bytes as f64 / seconds / 1e9
}

/// Runs `f(rank)` on one thread per rank; the seconds until all have ended.
fn per_rank(f: impl Fn(usize) + Sync) -> f64 {
    let start = Instant::now();
    std::thread::scope(|s| {
        for rank in 0..WORLD {
            let f = &f;
            s.spawn(move || f(rank));
        }
    });
    start.elapsed().as_secs_f64()
}

fn raw_write(path: &Path, bytes: &[u8], sync: bool) {
    let mut file = std::fs::File::create(path).expect("raw file");
    file.write_all(bytes).expect("raw write");
    if sync {
        file.sync_all().expect("raw sync");
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let base = args.next().map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    let runs: usize = args.next().and_then(|r| r.parse().ok()).unwrap_or(3);
    let root = base.join(format!("regflow-bench-checkpoint-{}", std::process::id()));
    let parts = parts();
    let raw: Vec<Vec<u8>> =
        parts.iter().map(|p| p.iter().flat_map(|part| part.value.to_le_bytes()).collect()).collect();
    let bytes: usize = raw.iter().map(Vec::len).sum();
    println!(
        "state: {TENSORS} tensors f32[{ROWS}, {COLUMNS}], {WORLD} ranks, {:.1} MiB, in {}",
        bytes as f64 / (1 << 20) as f64,
        root.display()
    );
    println!("{:<34} {:>9} {:>9}", "", "seconds", "GB/s");
    for run in 0..runs {
        let dir = root.join(format!("run{run}"));
        std::fs::create_dir_all(&dir).expect("bench directory");
        let row = |what: &str, seconds: f64| println!("{what:<34} {seconds:>9.3} {:>9.2}", gbps(bytes, seconds));
        let write = per_rank(|rank| raw_write(&dir.join(format!("raw{rank}")), &raw[rank], false));
        row("std::fs::write", write);
        let synced = per_rank(|rank| raw_write(&dir.join(format!("synced{rank}")), &raw[rank], true));
        row("std::fs::write + sync_all", synced);
        let checkpoint = dir.join("step1");
        let extra = serde_json::json!({ "run": run });
        let save = per_rank(|rank| {
            save_sharded(&checkpoint, rank as u32, WORLD as u32, 1, &parts[rank], &extra).expect("save_sharded")
        });
        row("save_sharded (2 ranks)", save);
        // What training waits for when it saves in the background: a copy of the state
        // (the job's read-back makes one) and the hand-off to the writing thread, against
        // a plain in-memory copy of the same bytes.
        let start = Instant::now();
        let copied: Vec<Vec<u8>> = raw.iter().map(|r| std::hint::black_box(r.clone())).collect();
        let memcpy = start.elapsed().as_secs_f64();
        drop(copied);
        row("memcpy of the state", memcpy);
        let background = dir.join("step2");
        let start = Instant::now();
        let handles: Vec<_> = (0..WORLD)
            .map(|rank| {
                let owned = parts[rank].clone();
                save_sharded_async(background.clone(), rank as u32, WORLD as u32, 2, owned, extra.clone())
            })
            .collect();
        let blocked = start.elapsed().as_secs_f64();
        row("blocked by save_sharded_async", blocked);
        for handle in handles {
            handle.wait().expect("save_sharded_async");
        }
        let start = Instant::now();
        for rank in 0..WORLD {
            std::hint::black_box(std::fs::read(dir.join(format!("synced{rank}"))).expect("raw read"));
        }
        row("std::fs::read", start.elapsed().as_secs_f64());
        let start = Instant::now();
        let loaded = load_sharded(&checkpoint).expect("load_sharded");
        row("load_sharded (whole tensors)", start.elapsed().as_secs_f64());
        assert_eq!(loaded.state_dict().len(), TENSORS);
        std::fs::remove_dir_all(&dir).expect("bench directory removed");
        println!();
    }
    let _ = std::fs::remove_dir_all(&root);
}
