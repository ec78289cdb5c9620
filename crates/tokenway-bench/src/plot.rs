//! Small SVG plots for benchmark reports (`plotters`, SVG backend only, no font files: text is
//! left to the SVG viewer, which keeps the files a few kilobytes and the build free of system
//! font libraries).

use std::path::Path;

use plotters::prelude::*;

/// One line of a plot: a label and its samples (any order).
#[derive(Clone, Debug)]
pub struct Series {
    /// Legend text.
    pub label: String,
    /// The samples, e.g. milliseconds.
    pub values: Vec<f64>,
}

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// Smallest value shown on the logarithmic axis.
const FLOOR: f64 = 0.01;

/// Points of the empirical CDF of `values` as a staircase: (x, fraction of samples <= x).
pub fn cdf_points(values: &[f64]) -> Vec<(f64, f64)> {
    let mut sorted: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len() as f64;
    let mut points = Vec::with_capacity(sorted.len() * 2);
    for (i, v) in sorted.iter().enumerate() {
        let v = v.max(FLOOR);
        points.push((v, i as f64 / n));
        points.push((v, (i + 1) as f64 / n));
    }
    points
}

/// Writes the CDFs of `series` to an SVG file at `path`, with a logarithmic x axis (latencies
/// on lossy links span several orders of magnitude). Series without samples are left out of
/// the plot but named in the legend as "(no data)".
pub fn cdf_svg(path: &Path, title: &str, x_label: &str, series: &[Series]) -> Result<(), String> {
    let all = series.iter().flat_map(|s| s.values.iter().copied());
    let (lo, hi) = all
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    let (lo, hi) = if lo.is_finite() && hi.is_finite() {
        ((lo.max(FLOOR)) / 1.2, hi.max(FLOOR) * 1.2)
    } else {
        (0.1, 10.0)
    };
    let root = SVGBackend::new(path, (720, 420)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| format!("plot {}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((lo..hi).log_scale(), 0f64..1.0)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc("fraction of requests")
        .x_label_formatter(&|v| format_tick(*v))
        .draw()
        .map_err(|e| err(&e))?;
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let points = cdf_points(&s.values);
        let label = if points.is_empty() {
            format!("{} (no data)", s.label)
        } else {
            s.label.clone()
        };
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(label)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

fn format_tick(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdf_is_a_staircase_ending_at_one() {
        let p = cdf_points(&[3.0, 1.0, 2.0]);
        assert_eq!(
            p,
            vec![
                (1.0, 0.0),
                (1.0, 1.0 / 3.0),
                (2.0, 1.0 / 3.0),
                (2.0, 2.0 / 3.0),
                (3.0, 2.0 / 3.0),
                (3.0, 1.0)
            ]
        );
        assert!(cdf_points(&[]).is_empty());
    }

    #[test]
    fn svg_file_is_written_with_every_label() {
        let dir = std::env::temp_dir().join(format!("tokenway-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("cdf.svg");
        cdf_svg(
            &path,
            "TTFT",
            "ms",
            &[
                Series {
                    label: "h1".into(),
                    values: vec![1.0, 2.0, 3.0],
                },
                Series {
                    label: "h3".into(),
                    values: vec![],
                },
            ],
        )
        .expect("plot");
        let svg = std::fs::read_to_string(&path).expect("svg written");
        assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(80)]);
        assert!(svg.contains("h1") && svg.contains("h3 (no data)"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
