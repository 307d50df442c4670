//! Loss curves drawn with `plotters`: PNG (its bitmap backend, encoded with `png`) or SVG,
//! chosen by the file's extension. No text is drawn, so no font library is needed: the
//! curve (log scale), its axes and a light grid at every power of ten.

use super::TrainError;
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::Path;

const WIDTH: u32 = 800;
const HEIGHT: u32 = 400;
const CURVE: RGBColor = RGBColor(30, 90, 200);
const GRID: RGBColor = RGBColor(220, 220, 220);

/// Writes the curve of `losses` (one point per step, log scale; non-finite and
/// non-positive values left out) to `path`: `.png` or `.svg`.
pub fn save_loss_plot(path: impl AsRef<Path>, losses: &[f64]) -> Result<(), TrainError> {
    let path = path.as_ref();
    let fail = |message: String| TrainError::Plot { path: path.display().to_string(), message };
    let points: Vec<(f64, f64)> =
        losses.iter().enumerate().filter(|(_, l)| l.is_finite() && **l > 0.0).map(|(i, &l)| (i as f64, l)).collect();
    if points.is_empty() {
        return Err(fail(format!("none of the {} losses is finite and positive: nothing to draw", losses.len())));
    }
    let extension = path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
    match extension.as_deref() {
        Some("svg") => {
            let root = SVGBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
            draw(&root, &points).map_err(fail)?;
            root.present().map_err(|e| fail(e.to_string()))
        }
        Some("png") => {
            let mut pixels = vec![0u8; (WIDTH * HEIGHT * 3) as usize];
            {
                let root = BitMapBackend::with_buffer(&mut pixels, (WIDTH, HEIGHT)).into_drawing_area();
                draw(&root, &points).map_err(fail)?;
                root.present().map_err(|e| fail(e.to_string()))?;
            }
            write_png(path, &pixels).map_err(fail)
        }
        _ => Err(fail("the file name must end in .png or .svg".into())),
    }
}

/// The chart on `root`: axes, grid, curve.
fn draw<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, points: &[(f64, f64)]) -> Result<(), String> {
    let text = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(text)?;
    let (lo, hi) = points.iter().fold((f64::MAX, f64::MIN), |(lo, hi), &(_, l)| (lo.min(l), hi.max(l)));
    // A flat curve still needs a range.
    let (lo, hi) = if hi > lo * 1.000_001 { (lo, hi) } else { (lo / 1.1, hi * 1.1) };
    let last = points.last().map_or(1.0, |&(x, _)| x).max(1.0);
    let mut chart =
        ChartBuilder::on(root).margin(20).build_cartesian_2d(0.0..last, (lo..hi).log_scale()).map_err(text)?;
    let mut decade = 10f64.powf(lo.log10().floor());
    while decade <= hi {
        for multiple in [1.0, 2.0, 5.0] {
            let y = decade * multiple;
            if (lo..=hi).contains(&y) {
                chart.draw_series(LineSeries::new([(0.0, y), (last, y)], GRID)).map_err(text)?;
            }
        }
        decade *= 10.0;
    }
    chart.draw_series(LineSeries::new([(0.0, lo), (0.0, hi)], BLACK)).map_err(text)?;
    chart.draw_series(LineSeries::new([(0.0, lo), (last, lo)], BLACK)).map_err(text)?;
    chart.draw_series(LineSeries::new(points.iter().copied(), CURVE.stroke_width(2))).map_err(text)?;
    Ok(())
}

/// Encodes RGB `pixels` of the chart's size as a PNG file.
fn write_png(path: &Path, pixels: &[u8]) -> Result<(), String> {
    let file = std::fs::File::create(path).map_err(|e| format!("cannot be created: {e}"))?;
    let mut encoder = png::Encoder::new(std::io::BufWriter::new(file), WIDTH, HEIGHT);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().map_err(|e| e.to_string())?;
    writer.write_image_data(pixels).map_err(|e| e.to_string())?;
    writer.finish().map_err(|e| e.to_string())
}
