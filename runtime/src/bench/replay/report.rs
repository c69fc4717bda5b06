//! The report: the table, the comparisons between policies, the JSON, the plots.

use super::*;

pub(super) fn gb(bytes: u64) -> f64 {
    bytes as f64 / 1e9
}

pub(super) fn render(trace: &Trace, args: &ReplayArgs, outcomes: &[Outcome]) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "replay of {} ({} sessions, {} requests) on {} node(s) × {} simulated H200 workers, {} ({}-token blocks), G1 {}/worker, G2 {}/node, G3 {}/node",
        trace.name,
        trace.sessions.len(),
        trace.requests,
        args.nodes,
        args.workers,
        args.model,
        args.block_tokens,
        args.g1,
        args.g2,
        args.g3
    );
    let _ = writeln!(
        out,
        "\n| policy | capacity | hit rate | G1 | G2 | G3 | G4 | TTFT p50 ms | p90 ms | p99 ms | queue ms (mean) | preempted | req/s (virtual) | G2→G1 GB | G3→G1 GB | G1→G2 GB | G2→G3 GB | G1 evictions (sys/conv/gen) | G3 lag ms mean/max | wall s | sim req/s |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for o in outcomes {
        let ev = |r: RegionKind| o.evictions[0].get(&r).copied().unwrap_or(0);
        let _ = writeln!(
            out,
            "| {} | {} | {:.1}% | {:.1}% | {:.1}% | {:.1}% | {:.1}% | {:.1} | {:.1} | {:.1} | {:.1} | {} | {:.2} | {:.0} | {:.0} | {:.0} | {:.0} | {}/{}/{} | {:.1}/{:.1} | {:.1} | {:.0} |",
            o.policy.name(),
            o.capacity.as_ref().map_or_else(|| "-".to_string(), |(t, s)| format!("{t}={s}")),
            o.hit_rate(None) * 100.0,
            o.hit_rate(Some(TierName::G1)) * 100.0,
            o.hit_rate(Some(TierName::G2)) * 100.0,
            o.hit_rate(Some(TierName::G3)) * 100.0,
            o.hit_rate(Some(TierName::G4)) * 100.0,
            o.percentile_ms(0.5),
            o.percentile_ms(0.9),
            o.percentile_ms(0.99),
            o.queue_ms,
            o.preempted,
            o.samples.len() as f64 / o.virtual_time.as_secs_f64().max(1e-9),
            gb(o.bytes[0]),
            gb(o.bytes[1]),
            gb(o.bytes[2]),
            gb(o.bytes[3]),
            ev(RegionKind::System),
            ev(RegionKind::Conversation),
            ev(RegionKind::Generated),
            o.lag_ms.0,
            o.lag_ms.1,
            o.wall.as_secs_f64(),
            o.samples.len() as f64 / o.wall.as_secs_f64().max(1e-9),
        );
    }
    if let Some(first) = outcomes.first() {
        let _ = writeln!(out, "\ninfinite-cache hit-rate bound: {:.1}%", first.bound_hit_rate * 100.0);
    }
    for line in comparisons(outcomes) {
        let _ = writeln!(out, "{line}");
    }
    out
}

pub(super) fn find(outcomes: &[Outcome], p: Policy) -> Option<&Outcome> {
    outcomes.iter().find(|o| o.policy == p && o.capacity.is_none())
}

/// The comparisons the replay exists for, as lines.
pub(super) fn comparisons(outcomes: &[Outcome]) -> Vec<String> {
    let mut lines = Vec::new();
    let best = find(outcomes, Policy::BEST);
    if let (Some(best), Some(base)) = (best, find(outcomes, Policy::BASELINE)) {
        lines.push(format!(
            "p50 TTFT baseline ({}) / best ({}): {:.2}x ({:.1} ms vs {:.1} ms); hit rate {:.1}% vs {:.1}%",
            base.policy.name(),
            best.policy.name(),
            base.percentile_ms(0.5) / best.percentile_ms(0.5).max(1e-9),
            base.percentile_ms(0.5),
            best.percentile_ms(0.5),
            base.hit_rate(None) * 100.0,
            best.hit_rate(None) * 100.0
        ));
    }
    if let (Some(best), Some(rr)) =
        (best, find(outcomes, Policy { routing: RoutingPolicy::RoundRobin, ..Policy::BEST }))
    {
        lines.push(format!(
            "p50 TTFT round_robin / kv_aware (both retention + G2+G3 write-through): {:.2}x ({:.1} ms vs {:.1} ms)",
            rr.percentile_ms(0.5) / best.percentile_ms(0.5).max(1e-9),
            rr.percentile_ms(0.5),
            best.percentile_ms(0.5)
        ));
    }
    if let (Some(best), Some(lru)) = (best, find(outcomes, Policy { eviction: Eviction::PlainLru, ..Policy::BEST })) {
        lines.push(format!(
            "retention-aware vs plain LRU at equal capacity: {:+.1} points of hit rate ({:.1}% vs {:.1}%), p50 TTFT {:.1} vs {:.1} ms",
            (best.hit_rate(None) - lru.hit_rate(None)) * 100.0,
            best.hit_rate(None) * 100.0,
            lru.hit_rate(None) * 100.0,
            best.percentile_ms(0.5),
            lru.percentile_ms(0.5)
        ));
    }
    if let (Some(best), Some(kept)) = (best, find(outcomes, Policy { preamble_kept: true, ..Policy::BEST })) {
        lines.push(format!(
            "p50 TTFT billing header kept / stripped: {:.2}x ({:.1} ms vs {:.1} ms; hit rate {:.1}% vs {:.1}%; \
             NVIDIA Dynamo reports 912 -> 169 ms, 5.4x)",
            kept.percentile_ms(0.5) / best.percentile_ms(0.5).max(1e-9),
            kept.percentile_ms(0.5),
            best.percentile_ms(0.5),
            kept.hit_rate(None) * 100.0,
            best.hit_rate(None) * 100.0
        ));
    }
    if let (Some(ignored), Some(honoured)) = (best, find(outcomes, Policy { priorities: true, ..Policy::BEST })) {
        let class = |o: &Outcome, high: bool, q: f64| {
            let mut v: Vec<f64> =
                o.samples.iter().filter(|s| s.high == high).map(|s| s.ttft.as_secs_f64() * 1e3).collect();
            v.sort_by(f64::total_cmp);
            v.get(((v.len().max(1) - 1) as f64 * q).round() as usize).copied().unwrap_or(0.0)
        };
        let lower = |q: f64| 1.0 - class(honoured, true, q) / class(ignored, true, q).max(1e-9);
        lines.push(format!(
            "priority (a fifth of the sessions at nvext.priority {HIGH_PRIORITY}), honoured vs ignored: high class p50 \
             {:.1} vs {:.1} ms ({:.0}% lower), p90 {:.1} vs {:.1} ms ({:.0}% lower); the rest p50 {:.2}x, p90 {:.2}x \
             (NVIDIA's NeMo Agent Toolkit router: up to 63% lower)",
            class(honoured, true, 0.5),
            class(ignored, true, 0.5),
            lower(0.5) * 100.0,
            class(honoured, true, 0.9),
            class(ignored, true, 0.9),
            lower(0.9) * 100.0,
            class(honoured, false, 0.5) / class(ignored, false, 0.5).max(1e-9),
            class(honoured, false, 0.9) / class(ignored, false, 0.9).max(1e-9),
        ));
    }
    for (what, leased) in
        [("the system prompts", Leased::System), ("the system prompts and the last message", Leased::Conversation)]
    {
        let (Some(plain), Some(leased)) = (best, find(outcomes, Policy { leased, ..Policy::BEST })) else { continue };
        lines.push(format!(
            "cache_control on {what} ({} min leases) vs none: system-region hit rate {:.1}% vs {:.1}%, \
             p50 TTFT {:.1} vs {:.1} ms ({:.2}x), p90 {:.1} vs {:.1} ms; overall hit rate {:.1}% vs {:.1}%",
            LEASE_TTL.as_secs() / 60,
            leased.system_hit_rate() * 100.0,
            plain.system_hit_rate() * 100.0,
            leased.percentile_ms(0.5),
            plain.percentile_ms(0.5),
            leased.percentile_ms(0.5) / plain.percentile_ms(0.5).max(1e-9),
            leased.percentile_ms(0.9),
            plain.percentile_ms(0.9),
            leased.hit_rate(None) * 100.0,
            plain.hit_rate(None) * 100.0,
        ));
    }
    if let Some(best) = best.filter(|b| !b.decisions_s.is_empty()) {
        lines.push(format!(
            "router decision of {} (wall time): p50 {:.1} µs, p99 {:.1} µs, max {:.1} µs over {} decisions",
            best.policy.name(),
            best.decision_us(0.5),
            best.decision_us(0.99),
            best.decision_us(1.0),
            best.decisions_s.len()
        ));
    }
    if let Some(best) = best {
        lines.push(format!(
            "best configuration vs the infinite-cache bound: {:.1}% vs {:.1}% ({:.1} points)",
            best.hit_rate(None) * 100.0,
            best.bound_hit_rate * 100.0,
            (best.bound_hit_rate - best.hit_rate(None)) * 100.0
        ));
    }
    lines
}

pub(super) fn report_json(trace: &Trace, args: &ReplayArgs, outcomes: &[Outcome]) -> serde_json::Value {
    serde_json::json!({
        "trace": trace.name,
        "sessions": trace.sessions.len(),
        "requests": trace.requests,
        "workers": args.workers,
        "model": args.model,
        "block_tokens": args.block_tokens,
        "capacity_bytes": {"g1_per_worker": args.g1.0, "g2": args.g2.0, "g3": args.g3.0},
        "bound_hit_rate": outcomes.first().map_or(0.0, |o| o.bound_hit_rate),
        "policies": outcomes.iter().map(Outcome::json).collect::<Vec<_>>(),
        "comparisons": comparisons(outcomes),
        "timeline": outcomes.first().map(|o| serde_json::json!(o.timeline)),
    })
}

pub(super) mod plots {
    //! SVG plots of a replay, drawn with `plotters`.

    use std::path::Path;

    use anyhow::Context;
    use plotters::prelude::*;

    use super::Outcome;

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

    fn err(e: impl std::fmt::Display) -> anyhow::Error {
        anyhow::anyhow!("drawing: {e}")
    }

    /// `ttft_cdf.svg`, `occupancy.svg`, and with a sweep `hit_rate_by_capacity.svg`.
    pub(in crate::bench::replay) fn draw(dir: &Path, outcomes: &[Outcome], sweep: bool) -> anyhow::Result<()> {
        ttft_cdf(&dir.join("ttft_cdf.svg"), outcomes).context("ttft_cdf.svg")?;
        if let Some(first) = outcomes.first() {
            occupancy(&dir.join("occupancy.svg"), first).context("occupancy.svg")?;
        }
        if sweep {
            by_capacity(&dir.join("hit_rate_by_capacity.svg"), outcomes).context("hit_rate_by_capacity.svg")?;
        }
        Ok(())
    }

    fn ttft_cdf(path: &Path, outcomes: &[Outcome]) -> anyhow::Result<()> {
        let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let max = outcomes.iter().flat_map(|o| o.ttfts_ms().last().copied()).fold(1.0f64, f64::max);
        let mut chart = ChartBuilder::on(&root)
            .caption("TTFT CDF per policy", ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d((1.0f64..max * 1.1).log_scale(), 0.0f64..1.0)
            .map_err(err)?;
        chart.configure_mesh().x_desc("TTFT (ms, log)").y_desc("fraction of requests").draw().map_err(err)?;
        for (i, o) in outcomes.iter().enumerate() {
            let v = o.ttfts_ms();
            let n = v.len().max(1) as f64;
            let color = COLORS[i % COLORS.len()];
            let label = match &o.capacity {
                Some((tier, size)) => format!("{} {tier}={size}", o.policy.name()),
                None => o.policy.name(),
            };
            chart
                .draw_series(LineSeries::new(
                    v.iter().enumerate().map(|(k, &ms)| (ms.max(1.0), (k + 1) as f64 / n)),
                    color.stroke_width(2),
                ))
                .map_err(err)?
                .label(label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
        }
        chart.configure_series_labels().border_style(BLACK).background_style(WHITE.mix(0.8)).draw().map_err(err)?;
        root.present().map_err(err)?;
        Ok(())
    }

    fn occupancy(path: &Path, o: &Outcome) -> anyhow::Result<()> {
        let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let end = o.timeline.last().map_or(1.0, |s| s.at_s).max(1.0);
        let top = o.timeline.iter().map(|s| (s.g1.max(0) as usize).max(s.g2).max(s.g3)).max().unwrap_or(1).max(1);
        let mut chart = ChartBuilder::on(&root)
            .caption(format!("Tier occupancy over time ({})", o.policy.name()), ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0f64..end, 0usize..top + top / 10)
            .map_err(err)?;
        chart.configure_mesh().x_desc("virtual time (s)").y_desc("blocks resident").draw().map_err(err)?;
        type Column = fn(&super::Occupancy) -> usize;
        let series: [(&str, Column); 3] =
            [("G1 (all workers)", |s| s.g1.max(0) as usize), ("G2", |s| s.g2), ("G3", |s| s.g3)];
        for (i, (name, f)) in series.iter().enumerate() {
            let color = COLORS[i];
            chart
                .draw_series(LineSeries::new(o.timeline.iter().map(|s| (s.at_s, f(s))), color.stroke_width(2)))
                .map_err(err)?
                .label(*name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
        }
        chart.configure_series_labels().border_style(BLACK).background_style(WHITE.mix(0.8)).draw().map_err(err)?;
        root.present().map_err(err)?;
        Ok(())
    }

    fn by_capacity(path: &Path, outcomes: &[Outcome]) -> anyhow::Result<()> {
        let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let points: Vec<(f64, f64)> = outcomes
            .iter()
            .filter_map(|o| {
                o.capacity.as_ref().map(|(_, s)| (s.0 as f64 / (1u64 << 30) as f64, o.hit_rate(None) * 100.0))
            })
            .collect();
        let tier = outcomes.iter().find_map(|o| o.capacity.as_ref().map(|(t, _)| t.clone())).unwrap_or_default();
        let max_x = points.iter().map(|p| p.0).fold(1.0f64, f64::max);
        let mut chart = ChartBuilder::on(&root)
            .caption(format!("Hit rate by {tier} capacity"), ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d(0.0f64..max_x * 1.1, 0.0f64..100.0)
            .map_err(err)?;
        chart.configure_mesh().x_desc(format!("{tier} capacity (GiB)")).y_desc("hit rate (%)").draw().map_err(err)?;
        chart.draw_series(LineSeries::new(points.iter().copied(), COLORS[0].stroke_width(2))).map_err(err)?;
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, COLORS[0].filled()))).map_err(err)?;
        root.present().map_err(err)?;
        Ok(())
    }
}
