//! `timeline.svg`: five panels over the run's time axis, read top to bottom.
//!
//! 1. **State**: a band per direction, coloured by BizTalk state code, with the phases marked.
//! 2. **Wait**: the delay (plus pacing interval) each admission saw, log scale.
//! 3. **Cause**: every condition that became active, as its value in percent of its threshold;
//!    the condition is active above the 100 % line and clears below the dashed resume line.
//! 4. **Concurrency**: each queue's effective limit and messages in flight: the limit drops
//!    under memory, in-process or thread pressure and grows back when it clears.
//! 5. **Flow**: messages offered, stored and processed per second, and the backlog waiting in
//!    the queues: what throttling held back, and where it went.

use std::path::Path;

use plotters::prelude::*;

use super::record::{RunResult, Sample};
use crate::throttling::{Condition, Direction};

const WIDTH: u32 = 1200;
const HEIGHT: u32 = 1450;

/// Colour of a state code.
fn state_color(code: u8) -> RGBColor {
    match code {
        0 => RGBColor(220, 237, 222),
        1 | 2 => RGBColor(250, 214, 90),
        3 => RGBColor(245, 150, 60),
        4 => RGBColor(220, 50, 47),
        5 => RGBColor(170, 30, 90),
        6 => RGBColor(140, 100, 200),
        8 => RGBColor(150, 110, 70),
        9 => RGBColor(230, 120, 180),
        10 | 11 => RGBColor(60, 120, 220),
        12 => RGBColor(90, 90, 90),
        13 => RGBColor(0, 150, 150),
        _ => RGBColor(128, 128, 128),
    }
}

fn condition_color(c: Condition) -> RGBColor {
    match c {
        Condition::RateImbalance => RGBColor(200, 160, 0),
        Condition::ProcessMemory => RGBColor(220, 50, 47),
        Condition::SystemMemory => RGBColor(170, 30, 90),
        Condition::InProcess => RGBColor(245, 130, 40),
        Condition::Threads => RGBColor(230, 100, 170),
        Condition::DatabaseSize => RGBColor(130, 90, 200),
        Condition::DatabaseSessions => RGBColor(140, 100, 60),
        Condition::Override => RGBColor(60, 120, 220),
        Condition::DownstreamOutage => RGBColor(90, 90, 90),
        Condition::DownstreamLatency => RGBColor(0, 150, 150),
    }
}

fn io_error(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

/// Draws the chart of a run into `path`.
pub fn write_svg(run: &RunResult, path: &Path) -> std::io::Result<()> {
    let root = SVGBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
    draw(run, &root).map_err(io_error)?;
    root.present().map_err(io_error)
}

type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

/// The legend every panel draws: small, boxed, half-transparent.
fn legend<'a, 'b: 'a, X, Y>(
    chart: &mut ChartContext<'a, SVGBackend<'b>, Cartesian2d<X, Y>>,
    position: SeriesLabelPosition,
) -> Result<(), Box<dyn std::error::Error>>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .label_font(("sans-serif", 11))
        .draw()?;
    Ok(())
}

fn draw(run: &RunResult, root: &Area) -> Result<(), Box<dyn std::error::Error>> {
    root.fill(&WHITE)?;
    let end = run.samples.last().map(|s| s.t).unwrap_or(1.0).max(1.0);
    let title = format!("throttlehost load: {}", run.scenario);
    let root = root.titled(&title, ("sans-serif", 22))?;
    let (top, rest) = root.split_vertically(230);
    let (middle, rest) = rest.split_vertically(300);
    let (bottom, rest) = rest.split_vertically(330);
    let (concurrency, flow) = rest.split_vertically(290);

    draw_states(run, &top, end)?;
    draw_waits(run, &middle, end)?;
    draw_causes(run, &bottom, end)?;
    draw_concurrency(run, &concurrency, end)?;
    draw_flow(run, &flow, end)?;
    Ok(())
}

/// Panel 1: each direction's state over time, in its colour, with the phases marked.
fn draw_states(run: &RunResult, area: &Area, end: f64) -> Result<(), Box<dyn std::error::Error>> {
    let mut chart = ChartBuilder::on(area)
        .margin(10)
        .x_label_area_size(25)
        .y_label_area_size(90)
        .caption(
            "throttling state (BizTalk code) per direction",
            ("sans-serif", 16),
        )
        .build_cartesian_2d(0f64..end, 0f64..2f64)?;
    chart
        .configure_mesh()
        .disable_mesh()
        .y_labels(0)
        .x_desc("seconds")
        .draw()?;
    let mut seen_codes: Vec<u8> = Vec::new();
    let mut previous = 0.0;
    for s in &run.samples {
        for (direction, lane) in [(Direction::Delivery, 1.0), (Direction::Publishing, 0.0)] {
            let code = s.snapshot.decision.direction(direction).state;
            if !seen_codes.contains(&code) {
                seen_codes.push(code);
            }
            chart.draw_series(std::iter::once(Rectangle::new(
                [(previous, lane + 0.1), (s.t, lane + 0.9)],
                state_color(code).filled(),
            )))?;
        }
        previous = s.t;
    }
    for (name, lane) in [("delivery", 1.5), ("publishing", 0.5)] {
        chart.draw_series(std::iter::once(Text::new(
            name,
            (end * 0.005, lane + 0.15),
            ("sans-serif", 13).into_font().color(&BLACK),
        )))?;
    }
    seen_codes.sort();
    for code in seen_codes {
        let name = if code == 0 {
            "0 not throttling".to_string()
        } else {
            let direction = if matches!(code, 2 | 6 | 8 | 11) {
                Direction::Publishing
            } else {
                Direction::Delivery
            };
            format!("{code} {}", crate::throttling::state_name(direction, code))
        };
        chart
            .draw_series(std::iter::once(Rectangle::new(
                [(0.0, 0.0), (0.0, 0.0)],
                state_color(code).filled(),
            )))?
            .label(name)
            .legend(move |(x, y)| {
                Rectangle::new([(x, y - 5), (x + 12, y + 5)], state_color(code).filled())
            });
    }
    for phase in &run.phases {
        chart.draw_series(std::iter::once(PathElement::new(
            vec![(phase.start, 0.0), (phase.start, 2.0)],
            BLACK.mix(0.4).stroke_width(1),
        )))?;
        chart.draw_series(std::iter::once(Text::new(
            phase.name.clone(),
            (phase.start + end * 0.003, 1.97),
            ("sans-serif", 11).into_font().color(&BLACK),
        )))?;
    }
    legend(&mut chart, SeriesLabelPosition::LowerRight)?;
    Ok(())
}

/// Panel 2: the wait each admission saw (delay and pacing interval), log scale.
fn draw_waits(run: &RunResult, area: &Area, end: f64) -> Result<(), Box<dyn std::error::Error>> {
    let max_wait = run
        .samples
        .iter()
        .flat_map(|s| {
            Direction::ALL.map(|d| {
                s.snapshot
                    .decision
                    .direction(d)
                    .effective_wait()
                    .as_secs_f64()
            })
        })
        .fold(0.01f64, f64::max);
    let mut chart = ChartBuilder::on(area)
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(90)
        .caption(
            "wait per admission (delay + pacing interval), seconds, log scale",
            ("sans-serif", 16),
        )
        .build_cartesian_2d(0f64..end, (0.0005f64..max_wait * 2.0).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("seconds")
        .y_label_formatter(&|y| super::units::format_wait(std::time::Duration::from_secs_f64(*y)))
        .draw()?;
    for (direction, color) in [
        (Direction::Delivery, RGBColor(31, 119, 180)),
        (Direction::Publishing, RGBColor(255, 127, 14)),
    ] {
        let mut segment: Vec<(f64, f64)> = Vec::new();
        let mut segments: Vec<Vec<(f64, f64)>> = Vec::new();
        for s in &run.samples {
            let w = s
                .snapshot
                .decision
                .direction(direction)
                .effective_wait()
                .as_secs_f64();
            if w > 0.0 {
                segment.push((s.t, w));
            } else if !segment.is_empty() {
                segments.push(std::mem::take(&mut segment));
            }
        }
        if !segment.is_empty() {
            segments.push(segment);
        }
        let mut first = true;
        for seg in segments {
            let series = chart.draw_series(LineSeries::new(seg, color.stroke_width(2)))?;
            if first {
                series.label(direction.name()).legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 15, y)], color.stroke_width(2))
                });
                first = false;
            }
        }
    }
    legend(&mut chart, SeriesLabelPosition::UpperRight)?;
    Ok(())
}

/// Panel 3, what triggered it: every condition that became active, in % of its threshold.
fn draw_causes(run: &RunResult, area: &Area, end: f64) -> Result<(), Box<dyn std::error::Error>> {
    let mut causes: Vec<(Condition, Direction)> = Vec::new();
    for s in &run.samples {
        for direction in Direction::ALL {
            for c in s.snapshot.decision.direction(direction).active() {
                let shared = !matches!(c.condition, Condition::RateImbalance | Condition::Override);
                let already = causes
                    .iter()
                    .any(|(x, d)| *x == c.condition && (shared || *d == direction));
                if c.condition != Condition::Override && c.threshold > 0.0 && !already {
                    causes.push((c.condition, direction));
                }
            }
        }
    }
    let percent = |s: &Sample, condition: Condition, direction: Direction| {
        s.snapshot
            .decision
            .direction(direction)
            .conditions
            .iter()
            .find(|c| c.condition == condition && c.threshold > 0.0)
            .map(|c| c.value / c.threshold * 100.0)
    };
    let top_percent = run
        .samples
        .iter()
        .flat_map(|s| causes.iter().filter_map(move |(c, d)| percent(s, *c, *d)))
        .fold(150.0f64, f64::max);
    let mut chart = ChartBuilder::on(area)
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(90)
        .caption("what triggered it: value in % of threshold (active above 100 %, clears below the dashed line)", ("sans-serif", 16))
        .build_cartesian_2d(0f64..end, 0f64..top_percent * 1.05)?;
    chart
        .configure_mesh()
        .x_desc("seconds")
        .y_desc("% of threshold")
        .draw()?;
    let resume = run.resume_ratio * 100.0;
    chart.draw_series(std::iter::once(PathElement::new(
        vec![(0.0, 100.0), (end, 100.0)],
        BLACK.stroke_width(1),
    )))?;
    chart.draw_series(DashedLineSeries::new(
        vec![(0.0, resume), (end, resume)],
        6,
        4,
        BLACK.mix(0.5).stroke_width(1),
    ))?;
    for (condition, direction) in causes {
        let color = condition_color(condition);
        let points: Vec<(f64, f64)> = run
            .samples
            .iter()
            .filter_map(|s| percent(s, condition, direction).map(|p| (s.t, p)))
            .collect();
        // The axis reaches the highest value (no cap), and each label says its peak.
        let peak = points.iter().map(|p| p.1).fold(0.0f64, f64::max);
        let label = if condition == Condition::RateImbalance {
            format!(
                "{} rate in / (out x overdrive), peak {peak:.0} %",
                direction.name()
            )
        } else {
            format!("{}, peak {peak:.0} %", condition.name().replace('_', " "))
        };
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))?
            .label(label)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 15, y)], color.stroke_width(2))
            });
    }
    legend(&mut chart, SeriesLabelPosition::UpperRight)?;
    Ok(())
}

/// Panel 4: each queue's effective limit and messages in flight.
fn draw_concurrency(
    run: &RunResult,
    area: &Area,
    end: f64,
) -> Result<(), Box<dyn std::error::Error>> {
    let queues: Vec<String> = run
        .samples
        .first()
        .map(|s| s.queues.iter().map(|q| q.0.clone()).collect())
        .unwrap_or_default();
    let top_limit = run
        .samples
        .iter()
        .flat_map(|s| s.queues.iter().map(|q| q.1.max(q.2)))
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let mut chart = ChartBuilder::on(area)
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(90)
        .caption(
            "concurrency per queue: effective limit (solid) and in flight (thin)",
            ("sans-serif", 16),
        )
        .build_cartesian_2d(0f64..end, 0f64..top_limit * 1.1)?;
    chart
        .configure_mesh()
        .x_desc("seconds")
        .y_desc("messages")
        .draw()?;
    let palette = [
        RGBColor(31, 119, 180),
        RGBColor(44, 160, 44),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
    ];
    for (i, name) in queues.iter().enumerate() {
        let color = palette[i % palette.len()];
        let limit: Vec<(f64, f64)> = run
            .samples
            .iter()
            .filter_map(|s| s.queues.get(i).map(|q| (s.t, q.1 as f64)))
            .collect();
        let in_flight: Vec<(f64, f64)> = run
            .samples
            .iter()
            .filter_map(|s| s.queues.get(i).map(|q| (s.t, q.2 as f64)))
            .collect();
        chart
            .draw_series(LineSeries::new(limit, color.stroke_width(2)))?
            .label(format!("{name} limit"))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 15, y)], color.stroke_width(2))
            });
        chart.draw_series(LineSeries::new(in_flight, color.mix(0.5).stroke_width(1)))?;
    }
    legend(&mut chart, SeriesLabelPosition::UpperRight)?;
    Ok(())
}

/// Panel 5, where the messages are: offered, stored and processed per second (recent
/// rates), and the backlog waiting in the queues, on its own scale at the right.
fn draw_flow(run: &RunResult, area: &Area, end: f64) -> Result<(), Box<dyn std::error::Error>> {
    let rates = |f: fn(&Sample) -> f64| -> Vec<(f64, f64)> {
        run.samples.iter().map(|s| (s.t, f(s))).collect()
    };
    let offered = rates(|s| s.snapshot.readings.publishing.recent_incoming_per_sec);
    let stored = rates(|s| s.snapshot.readings.publishing.recent_outgoing_per_sec);
    let processed = rates(|s| s.snapshot.readings.delivery.recent_outgoing_per_sec);
    let backlog: Vec<(f64, f64)> = run
        .samples
        .iter()
        .map(|s| (s.t, s.queues.iter().map(|q| q.3).sum::<u64>() as f64))
        .collect();
    let top_rate = [&offered, &stored, &processed]
        .iter()
        .flat_map(|v| v.iter().map(|p| p.1))
        .fold(1.0f64, f64::max);
    let top_backlog = backlog.iter().map(|p| p.1).fold(1.0f64, f64::max);
    let mut chart = ChartBuilder::on(area)
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(90)
        .right_y_label_area_size(90)
        .caption(
            "messages per second: offered, stored, processed; backlog in the queues (right axis)",
            ("sans-serif", 16),
        )
        .build_cartesian_2d(0f64..end, 0f64..top_rate * 1.1)?
        .set_secondary_coord(0f64..end, 0f64..top_backlog * 1.1);
    chart
        .configure_mesh()
        .x_desc("seconds")
        .y_desc("messages / s")
        .draw()?;
    chart
        .configure_secondary_axes()
        .y_desc("messages waiting")
        .draw()?;
    let series = [
        ("offered (sends requested)", offered, RGBColor(214, 39, 40)),
        ("stored (sends admitted)", stored, RGBColor(255, 127, 14)),
        ("processed", processed, RGBColor(44, 160, 44)),
    ];
    for (label, points, color) in series {
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))?
            .label(label)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 15, y)], color.stroke_width(2))
            });
    }
    let grey = RGBColor(90, 90, 90);
    chart
        .draw_secondary_series(LineSeries::new(backlog, grey.stroke_width(1)))?
        .label("backlog (right axis)")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], grey.stroke_width(1)));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 12))
        .draw()?;
    Ok(())
}
