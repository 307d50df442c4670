//! Serving benchmark: a 784-1024-1024-10 f32 MLP through `regflow_serve::Model` (plan
//! compiled for batch 64, dynamic batching), against the same plans run through a `Job`
//! directly.
//!
//! ```text
//! cargo run --release --example bench_serve -- [--seconds 2] [--max-delay-us 2000] [--input-registers 1] [--plot docs/serving_latency.png]
//! ```
//!
//! Measures: closed loops (threads calling `infer` with one-row requests) at concurrency
//! 1, 2, 4, 8, 16, 32, 64; open loops at fixed arrival rates; p50/p99 latency and
//! throughput of each; then (a) the latency the `Model` adds to a batch-1 plan fed and
//! fetched directly, (b) offline throughput (full batches of 64 back to back through a
//! `Job`) against concurrency 64, (c) the time `try_infer` takes to answer `Overloaded`.

#[path = "common/mlp.rs"]
mod mlp;

use clap::Parser;
use plotters::prelude::*;
use regflow::graph::{CompileOptions, HostArray};
use regflow::prelude::Job;
use regflow_serve::{InferFuture, Model, ServeError};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Serving benchmark of a 784-1024-1024-10 MLP.
#[derive(Debug, Parser)]
struct Options {
    /// Seconds per measured point.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// Dynamic batching's maximum wait for company, in microseconds.
    #[arg(long, default_value_t = 2000)]
    max_delay_us: u64,
    /// Threads each CPU kernel may use.
    #[arg(long, default_value_t = 1)]
    cpu_threads: usize,
    /// Slots of the plan's input registers: pieces pushed ahead of the one computing (the
    /// compiler's default is 2; 1 leaves more requests in the queue to batch together).
    #[arg(long, default_value_t = 1)]
    input_registers: u32,
    /// Rows of the batched plan (the most a piece carries). With fewer rows than callers,
    /// one full piece waits while another computes.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Where to draw the latency-throughput plot (PNG).
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
}

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn shape() -> mlp::MlpShape {
    mlp::MlpShape { widths: vec![784, 1024, 1024, 10] }
}

fn model(batch: usize, options: &Options, batching: bool, queue: usize) -> Result<Model> {
    let compile = CompileOptions { input_register_num: options.input_registers, ..CompileOptions::default() };
    let mut builder =
        Model::builder(shape().plan_with(batch, &compile)?).cpu_threads(options.cpu_threads).queue_capacity(queue);
    if batching {
        builder = builder.dynamic_batching(Duration::from_micros(options.max_delay_us));
    }
    Ok(builder.build()?)
}

fn one_row(seed: u64) -> HostArray {
    HostArray { shape: [1, 784].into(), data: regflow::plan::HostData::F32(mlp::input_row(784, seed)) }
}

/// Latency percentiles and throughput of one measured point.
#[derive(Debug, Clone)]
struct Point {
    label: String,
    requests: usize,
    throughput: f64,
    p50: Duration,
    p99: Duration,
}

impl Point {
    fn new(label: String, mut latencies: Vec<Duration>, elapsed: Duration, rows_per_request: usize) -> Point {
        latencies.sort();
        let at = |q: f64| latencies.get(((latencies.len() as f64 * q) as usize).min(latencies.len().saturating_sub(1)));
        Point {
            label,
            requests: latencies.len(),
            throughput: (latencies.len() * rows_per_request) as f64 / elapsed.as_secs_f64(),
            p50: at(0.50).copied().unwrap_or_default(),
            p99: at(0.99).copied().unwrap_or_default(),
        }
    }

    fn row(&self) -> String {
        format!(
            "| {} | {} | {:.0} | {:.3} | {:.3} |",
            self.label,
            self.requests,
            self.throughput,
            self.p50.as_secs_f64() * 1e3,
            self.p99.as_secs_f64() * 1e3
        )
    }
}

/// `threads` callers each calling `infer` with one row, back to back, for `seconds`.
fn closed_loop(model: &Model, threads: usize, seconds: f64, label: &str) -> Result<Point> {
    let until = Instant::now() + Duration::from_secs_f64(seconds);
    let start = Instant::now();
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let model = model.clone();
            std::thread::spawn(move || -> std::result::Result<Vec<Duration>, ServeError> {
                let input = one_row(t as u64);
                let mut latencies = Vec::new();
                while Instant::now() < until {
                    let request = input.clone();
                    let sent = Instant::now();
                    model.infer([("x", request)])?;
                    latencies.push(sent.elapsed());
                }
                Ok(latencies)
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for worker in workers {
        latencies.extend(worker.join().map_err(|_| "a caller panicked")??);
    }
    Ok(Point::new(format!("{label}, concurrency {threads}"), latencies, start.elapsed(), 1))
}

/// Requests arriving at `rate` per second for `seconds` (submitted with `infer_async`,
/// whatever the answers do); latency counts from each request's scheduled arrival.
fn open_loop(model: &Model, rate: f64, seconds: f64) -> Result<(Point, u64)> {
    let count = (rate * seconds) as usize;
    let (tx, rx) = crossbeam_channel::unbounded::<(Instant, InferFuture)>();
    let waiter = std::thread::spawn(move || {
        let mut latencies = Vec::with_capacity(count);
        let mut refused = 0u64;
        for (arrival, future) in rx {
            match future.wait() {
                Ok(_) => latencies.push(arrival.elapsed()),
                Err(_) => refused += 1,
            }
        }
        (latencies, refused)
    });
    let input = one_row(7);
    let start = Instant::now();
    for i in 0..count {
        let arrival = start + Duration::from_secs_f64(i as f64 / rate);
        let now = Instant::now();
        if arrival > now {
            std::thread::sleep(arrival - now);
        }
        let future = model.infer_async([("x", input.clone())]);
        if tx.send((arrival, future)).is_err() {
            break;
        }
    }
    drop(tx);
    let (latencies, refused) = waiter.join().map_err(|_| "the waiter panicked")?;
    Ok((Point::new(format!("open loop, {rate:.0} req/s"), latencies, start.elapsed(), 1), refused))
}

/// The same plan's job, fed and fetched directly: one-row pieces one after the other
/// (`batch` 1), the latency of each.
fn direct_single(seconds: f64, options: &Options) -> Result<Point> {
    let plan = shape().plan(1)?;
    let sink = {
        let output = plan.signature.outputs.first().ok_or("the plan has no output")?;
        plan.actors[output.actor.index()].name.clone()
    };
    let mut job = Job::builder(plan).cpu_threads(options.cpu_threads).build()?;
    let mut feeds = job.graph_feeds()?;
    let fetcher = job.fetcher(&sink)?;
    let input = one_row(3);
    let (mut latencies, start) = (Vec::new(), Instant::now());
    let until = start + Duration::from_secs_f64(seconds);
    while Instant::now() < until {
        let sent = Instant::now();
        feeds.push("x", &input)?;
        let fetched = fetcher.recv().ok_or("the job ended early")?;
        std::hint::black_box(fetched.bytes());
        drop(fetched);
        latencies.push(sent.elapsed());
    }
    drop(feeds);
    drop(fetcher);
    job.wait()?;
    Ok(Point::new("direct Job, batch-1 plan, one at a time".into(), latencies, start.elapsed(), 1))
}

/// Full batches of 64 rows pushed back to back into the batch-64 plan's job by one thread
/// and fetched by another: the throughput with no serving layer and no idle row.
fn offline_batched(seconds: f64, options: &Options) -> Result<Point> {
    let batch = options.batch;
    let plan = shape().plan(batch)?;
    let sink = {
        let output = plan.signature.outputs.first().ok_or("the plan has no output")?;
        plan.actors[output.actor.index()].name.clone()
    };
    let mut job = Job::builder(plan).cpu_threads(options.cpu_threads).build()?;
    let mut feeds = job.graph_feeds()?;
    let fetcher = job.fetcher(&sink)?;
    let input = HostArray {
        shape: [batch, 784].into(),
        data: regflow::plan::HostData::F32((0..batch as u64).flat_map(|r| mlp::input_row(784, r)).collect()),
    };
    let pieces = (seconds * 200.0) as usize + 16;
    let feeder = std::thread::spawn(move || -> Result<()> {
        for _ in 0..pieces {
            feeds.push("x", &input)?;
        }
        Ok(())
    });
    let start = Instant::now();
    let (mut latencies, mut last) = (Vec::new(), start);
    let until = start + Duration::from_secs_f64(seconds);
    let mut received = 0;
    while received < pieces {
        let fetched = fetcher.recv().ok_or("the job ended early")?;
        drop(fetched);
        received += 1;
        latencies.push(last.elapsed());
        last = Instant::now();
        if last >= until {
            break;
        }
    }
    let elapsed = start.elapsed();
    // Read the rest so the feeder finishes, then end the job.
    while received < pieces && fetcher.recv().is_some() {
        received += 1;
    }
    feeder.join().map_err(|_| "the feeder panicked")??;
    drop(fetcher);
    job.wait()?;
    Ok(Point::new(format!("offline: full batches of {batch} through a Job"), latencies, elapsed, batch))
}

/// How long `try_infer` takes to answer `Overloaded` while 8 callers keep a queue of 4 full.
fn overload_answer(options: &Options) -> Result<(Duration, Duration, Duration, usize)> {
    let model = model(1, options, false, 4)?;
    let stop = Arc::new(AtomicBool::new(false));
    let flooders: Vec<_> = (0..8)
        .map(|t| {
            let (model, stop) = (model.clone(), stop.clone());
            std::thread::spawn(move || {
                let input = one_row(t);
                while !stop.load(Ordering::Relaxed) {
                    let _ = model.infer([("x", input.clone())]);
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    let input = one_row(11);
    let mut refusals = Vec::new();
    for _ in 0..20_000 {
        let request = input.clone();
        let sent = Instant::now();
        let answer = model.try_infer([("x", request)]);
        let took = sent.elapsed();
        if matches!(answer, Err(ServeError::Overloaded { .. })) {
            refusals.push(took);
        }
    }
    stop.store(true, Ordering::Relaxed);
    for flooder in flooders {
        flooder.join().map_err(|_| "a flooder panicked")?;
    }
    model.shutdown()?;
    refusals.sort();
    let at = |q: f64| refusals.get(((refusals.len() as f64 * q) as usize).min(refusals.len().saturating_sub(1)));
    let (p50, p99, max) = (at(0.5), at(0.99), refusals.last());
    match (p50, p99, max) {
        (Some(p50), Some(p99), Some(max)) => Ok((*p50, *p99, *max, refusals.len())),
        _ => Err("the queue never filled: no try_infer answered Overloaded".into()),
    }
}

/// Latency (log scale: light grid lines at 0.1, 1, 10, 100 ms; the bottom line is 1 ms at most) against throughput (grid
/// lines every power of ten below the largest); blue: closed-loop p50, red: closed-loop p99
/// (concurrency 1 to 64 from left to right), green and orange: open-loop p50 and p99.
fn plot(path: &std::path::Path, closed: &[Point], open: &[Point]) -> Result<()> {
    let (w, h) = (640u32, 400u32);
    let mut pixels = vec![255u8; (w * h * 3) as usize];
    {
        let all = closed.iter().chain(open);
        let x_max = all.clone().map(|p| p.throughput).fold(1.0, f64::max) * 1.1;
        let ms = |d: Duration| (d.as_secs_f64() * 1e3).max(1e-3).log10();
        let y_min = all.clone().map(|p| ms(p.p50)).fold(f64::MAX, f64::min).min(0.0) - 0.3;
        let y_max = all.map(|p| ms(p.p99)).fold(0.0, f64::max) + 0.3;
        let root = BitMapBackend::with_buffer(&mut pixels, (w, h)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root).margin(20).build_cartesian_2d(0f64..x_max, y_min..y_max)?;
        let grid = RGBColor(220, 220, 220);
        for decade in [-1.0, 0.0, 1.0, 2.0, 3.0] {
            if decade > y_min && decade < y_max {
                chart.draw_series(std::iter::once(PathElement::new(vec![(0.0, decade), (x_max, decade)], grid)))?;
            }
        }
        let step = 10f64.powf(x_max.log10().floor());
        let mut x = step;
        while x < x_max {
            chart.draw_series(std::iter::once(PathElement::new(vec![(x, y_min), (x, y_max)], grid)))?;
            x += step;
        }
        chart
            .draw_series(std::iter::once(PathElement::new(vec![(0.0, y_max), (0.0, y_min), (x_max, y_min)], BLACK)))?;
        for (points, p50_color, p99_color) in [(closed, BLUE, RED), (open, GREEN, RGBColor(255, 140, 0))] {
            for (pick, color) in [(0, p50_color), (1, p99_color)] {
                let series: Vec<(f64, f64)> =
                    points.iter().map(|p| (p.throughput, ms(if pick == 0 { p.p50 } else { p.p99 }))).collect();
                chart.draw_series(LineSeries::new(series.clone(), color.stroke_width(2)))?;
                chart.draw_series(series.into_iter().map(|xy| Circle::new(xy, 4, color.filled())))?;
            }
        }
        root.present()?;
    }
    let file = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut encoder = png::Encoder::new(file, w, h);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder.set_compression(png::Compression::Best);
    encoder.write_header()?.write_image_data(&pixels)?;
    Ok(())
}

fn main() -> Result<()> {
    let options = Options::parse();
    let seconds = options.seconds;
    println!(
        "MLP 784-1024-1024-10 f32, cpu_threads {}, {seconds} s per point, max delay {} us, input registers {}\n",
        options.cpu_threads, options.max_delay_us, options.input_registers
    );
    println!("| run | requests | rows/s | p50 ms | p99 ms |\n| --- | ---: | ---: | ---: | ---: |");

    let direct = direct_single(seconds, &options)?;
    println!("{}", direct.row());
    let single = model(1, &options, false, regflow_serve::DEFAULT_QUEUE)?;
    let served_single = closed_loop(&single, 1, seconds, "Model, batch-1 plan")?;
    println!("{}", served_single.row());
    single.shutdown()?;

    let offline = offline_batched(seconds, &options)?;
    println!("{}", offline.row());

    let batched = model(options.batch, &options, true, regflow_serve::DEFAULT_QUEUE)?;
    let mut closed = Vec::new();
    for threads in [1, 2, 4, 8, 16, 32, 64] {
        let point = closed_loop(&batched, threads, seconds, "Model, batched plan, dynamic batching")?;
        println!("{}", point.row());
        closed.push(point);
    }
    let peak = closed.iter().map(|p| p.throughput).fold(0.0, f64::max);
    let mut open = Vec::new();
    for fraction in [0.25, 0.5, 0.75, 0.9] {
        let (point, refused) = open_loop(&batched, peak * fraction, seconds)?;
        println!("{} (refused {refused})", point.row());
        open.push(point);
    }
    let snapshot = batched.metrics();
    batched.shutdown()?;
    println!(
        "\nbatching: {} pieces carried {} rows ({:.1} rows per piece)",
        snapshot.pieces,
        snapshot.batched_rows,
        snapshot.batched_rows as f64 / snapshot.pieces.max(1) as f64
    );

    let (p50, p99, max, refusals) = overload_answer(&options)?;
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let c64 = closed.last().map_or(0.0, |p| p.throughput);
    println!(
        "\n(a) added latency at concurrency 1 (Model minus direct Job, batch-1 plan): p50 {:+.1} us (target <= 50 us), \
         p99 {:+.1} us",
        us(served_single.p50) - us(direct.p50),
        us(served_single.p99) - us(direct.p99)
    );
    println!(
        "(b) concurrency 64 / offline batched throughput: {c64:.0} / {:.0} rows/s = {:.2} (target >= 0.9)",
        offline.throughput,
        c64 / offline.throughput
    );
    println!(
        "(c) try_infer answering Overloaded on a full queue: p50 {:.2} us, p99 {:.2} us, max {:.1} us over {refusals} refusals (target < 1 ms)",
        p50.as_secs_f64() * 1e6,
        p99.as_secs_f64() * 1e6,
        max.as_secs_f64() * 1e6
    );
    if let Some(path) = &options.plot {
        plot(path, &closed, &open)?;
        println!("plot written to {}", path.display());
    }
    Ok(())
}
