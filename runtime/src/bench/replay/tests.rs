use super::*;

/// A simulated replay of `trace` on one node of 4 workers with large tiers, comparing routing.
fn args(trace: PathBuf) -> ReplayArgs {
    ReplayArgs {
        trace,
        format: None,
        workers: 4,
        nodes: 1,
        model: "llama-8b".into(),
        block_tokens: 64,
        g1: ByteSize(80 << 30),
        g2: ByteSize(1 << 40),
        g3: ByteSize(0),
        compare: vec![Axis::Routing],
        sweep: None,
        limit: None,
        load: vec![1.0],
        load_of: LoadOf::Trace,
        calibration: None,
        engine: ReplayEngine::Simulated,
        config: None,
        decode_ms: None,
        json: None,
        plots: None,
    }
}

#[test]
fn trace_tokens_are_a_function_of_the_hash_ids() {
    assert_eq!(tokens_of(&[1, 2], 1024), tokens_of(&[1, 2], 1024));
    assert_eq!(tokens_of(&[1, 2], 700).len(), 700);
    assert_eq!(tokens_of(&[1, 2], 1024)[..512], tokens_of(&[1, 3], 1024)[..512]);
    assert_ne!(tokens_of(&[1], 512), tokens_of(&[2], 512));
}

/// `--compare preamble`: with the billing header kept, every request starts with tokens of
/// its own and reuses nothing; stripped, later turns read their prefix.
#[test]
fn a_kept_preamble_reuses_no_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.jsonl");
    let mut lines = String::new();
    for s in 0..4u64 {
        let first: Vec<u64> = (0..8).collect();
        lines.push_str(&format!(
            "{{\"session_id\":\"s{s}\",\"timestamp\":{},\"input_length\":{},\"output_length\":20,\"hash_ids\":{first:?}}}\n",
            s * 10,
            first.len() * 512
        ));
        lines.push_str(&format!(
            "{{\"session_id\":\"s{s}\",\"input_length\":300,\"output_length\":20,\"hash_ids\":[{}],\"delay\":1000}}\n",
            1000 + s
        ));
    }
    std::fs::write(&path, lines).unwrap();
    let args = ReplayArgs { compare: vec![Axis::Preamble], ..args(path) };
    let (_, outcomes) = replay(&args).unwrap();
    let names: Vec<String> = outcomes.iter().map(|o| o.policy.name()).collect();
    assert_eq!(names[..2], ["kv_aware+retention+wt-g2g3", "kv_aware+retention+wt-g2g3+preamble-kept"]);
    let (stripped, kept) = (&outcomes[0], &outcomes[1]);
    assert!(stripped.hit_rate(None) > 0.25, "{}", stripped.hit_rate(None));
    assert_eq!(kept.hit_rate(None), 0.0);
    assert!(kept.samples.iter().zip(&stripped.samples).all(|(k, s)| k.prompt == s.prompt + PREAMBLE_TOKENS));
    assert!(comparisons(&outcomes).iter().any(|l| l.starts_with("p50 TTFT billing header kept / stripped")));
}

#[test]
fn a_small_agentic_trace_replays_and_kv_aware_routing_hits_more() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.jsonl");
    let mut lines = String::new();
    for s in 0..6u64 {
        let first: Vec<u64> = (0..8).chain((100 * (s + 1))..(100 * (s + 1) + 4)).collect();
        lines.push_str(&format!(
            "{{\"session_id\":\"s{s}\",\"timestamp\":{},\"input_length\":{},\"output_length\":40,\"hash_ids\":{first:?}}}\n",
            s * 10,
            first.len() * 512
        ));
        for t in 0..3u64 {
            let id = 10_000 + s * 10 + t;
            lines.push_str(&format!(
                "{{\"session_id\":\"s{s}\",\"input_length\":300,\"output_length\":30,\"hash_ids\":[{id}],\"delay\":1500}}\n"
            ));
        }
    }
    std::fs::write(&path, lines).unwrap();
    let args =
        ReplayArgs { json: Some(dir.path().join("out.json")), plots: Some(dir.path().join("plots")), ..args(path) };
    let trace = load_trace(&args.trace, None, None).unwrap();
    assert_eq!((trace.sessions.len(), trace.requests), (6, 24));
    let report = run(&args).unwrap();
    assert!(report.contains("| kv_aware+retention+wt-g2g3 |"), "{report}");
    assert!(report.contains("p50 TTFT round_robin / kv_aware"), "{report}");
    let (trace, outcomes) = replay(&args).unwrap();
    assert_eq!(trace.requests, 24);
    let names: Vec<String> = outcomes.iter().map(|o| o.policy.name()).collect();
    assert_eq!(
        names,
        [
            "kv_aware+retention+wt-g2g3",
            "round_robin+retention+wt-g2g3",
            "random+retention+wt-g2g3",
            "round_robin+lru+no-wt"
        ]
    );
    let (kv, rr) = (&outcomes[0], &outcomes[1]);
    assert_eq!((kv.samples.len(), rr.samples.len()), (24, 24));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("out.json")).unwrap()).unwrap();
    assert_eq!(json["policies"].as_array().map(Vec::len), Some(4));
    assert!(json["policies"][0]["ttft_ms"]["p50"].as_f64().unwrap() > 0.0);
    assert!(json["bound_hit_rate"].as_f64().unwrap() > 0.5);
    for plot in ["ttft_cdf.svg", "occupancy.svg"] {
        let svg = std::fs::read_to_string(dir.path().join("plots").join(plot)).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("<polyline"), "{plot}: {}", &svg[..svg.len().min(200)]);
    }
    // Later turns find their session's history: in G1 of the same worker with KV-aware
    // routing, over the link from G2 otherwise (loads this small hide behind the step they
    // join, so the first token comes no later).
    assert!(kv.hit_rate(Some(TierName::G1)) > rr.hit_rate(Some(TierName::G1)), "{report}");
    assert!(kv.percentile_ms(0.5) <= rr.percentile_ms(0.5), "{report}");
    assert!(kv.hit_rate(None) <= kv.bound_hit_rate + 1e-9, "never above the infinite cache: {report}");
}

#[test]
fn under_a_burst_past_the_cache_kv_aware_hits_no_less_and_preempts_no_more_than_random() {
    // 24 sessions open at once over a shared system prompt, each growing by 1,024 tokens a
    // turn every 2 s, on 2 workers whose G1 (and the node's G2) hold the contexts of a few:
    // served all at once they evict each other's before every next turn.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("burst.jsonl");
    let mut lines = String::new();
    for s in 0..24u64 {
        let first: Vec<u64> = (0..4).chain((1000 * (s + 1))..(1000 * (s + 1) + 4)).collect();
        lines.push_str(&format!(
            "{{\"session_id\":\"s{s}\",\"timestamp\":0,\"input_length\":{},\"output_length\":64,\"hash_ids\":{first:?}}}\n",
            first.len() * 512
        ));
        for t in 0..6u64 {
            let id = 1000 * (s + 1) + 10 + 2 * t;
            lines.push_str(&format!(
                "{{\"session_id\":\"s{s}\",\"input_length\":1024,\"output_length\":64,\"hash_ids\":[{id},{}],\"delay\":2000}}\n",
                id + 1
            ));
        }
    }
    std::fs::write(&path, lines).unwrap();
    let args = ReplayArgs { workers: 2, g1: ByteSize(2 << 30), g2: ByteSize(4 << 30), ..args(path) };
    let (trace, outcomes) = replay(&args).unwrap();
    assert_eq!(trace.requests, 24 * 7);
    let by = |name: &str| outcomes.iter().find(|o| o.policy.name() == name).expect(name);
    let kv = by("kv_aware+retention+wt-g2g3");
    let random = by("random+retention+wt-g2g3");
    assert_eq!(kv.samples.len(), 24 * 7, "every request answered");
    assert!(
        kv.hit_rate(None) >= random.hit_rate(None),
        "hit rate: kv_aware {:.3} vs random {:.3}",
        kv.hit_rate(None),
        random.hit_rate(None)
    );
    assert!(kv.preempted <= random.preempted, "preempted: kv_aware {} vs random {}", kv.preempted, random.preempted);
}

#[test]
fn late_binding_serves_a_short_request_before_a_burst_queued_ahead_of_it() {
    // 32 sessions open at once with 12,288-token prompts on 2 workers (seconds of prefill
    // queued on each); a 512-token request comes 100 ms later. Routed at once, it joins a
    // worker's queue behind the burst; held at the router, it goes as soon as a worker has
    // no more than `router.late_binding` (1 s) of prefill ahead, before the long prompts
    // still held.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("burst.jsonl");
    let mut lines = String::new();
    for s in 0..32u64 {
        let ids: Vec<u64> = (1000 * (s + 1)..1000 * (s + 1) + 24).collect();
        lines.push_str(&format!(
            "{{\"session_id\":\"long{s}\",\"timestamp\":0,\"input_length\":{},\"output_length\":16,\"hash_ids\":{ids:?}}}\n",
            ids.len() * 512
        ));
    }
    lines.push_str(
        "{\"session_id\":\"short\",\"timestamp\":100,\"input_length\":512,\"output_length\":16,\"hash_ids\":[99999]}\n",
    );
    std::fs::write(&path, lines).unwrap();
    let config = dir.path().join("off.toml");
    std::fs::write(&config, "[router]\nlate_binding = \"0s\"\n").unwrap();
    let short_ttft = |config: Option<PathBuf>| {
        let args = ReplayArgs { workers: 2, compare: Vec::new(), config, ..args(path.clone()) };
        let (_, outcomes) = replay(&args).unwrap();
        let kv = &outcomes[0];
        assert_eq!(kv.samples.len(), 33, "every request answered");
        let short = kv.samples.iter().find(|s| s.prompt == 512).expect("the short request");
        let longest = kv.samples.iter().map(|s| s.ttft).max().unwrap();
        (short.ttft, longest)
    };
    let (held, held_longest) = short_ttft(None);
    let (queued, queued_longest) = short_ttft(Some(config));
    assert!(queued > Duration::from_secs(4), "routed at once it waits behind the burst: {queued:?}");
    assert!(held * 3 < queued, "held: {held:?}, routed at once: {queued:?}");
    // The burst itself is served no later for it (the same work, reordered).
    assert!(
        held_longest.as_secs_f64() <= queued_longest.as_secs_f64() * 1.1,
        "slowest: {held_longest:?} held vs {queued_longest:?}"
    );
}

#[test]
fn sessions_open_as_a_poisson_process_at_the_asked_rate() {
    let turn = || Turn { system_tokens: 0, at_ms: 77.0, delay_ms: 5.0, new_tokens: vec![1], output_length: 1 };
    let mut trace =
        Trace { name: "t".into(), sessions: (0..4000).map(|_| vec![turn(), turn()]).collect(), requests: 8000 };
    open_sessions(&mut trace, 4.0);
    let starts: Vec<f64> = trace.sessions.iter().map(|s| s[0].at_ms).collect();
    assert_eq!(starts[0], 0.0);
    assert!(starts.windows(2).all(|w| w[0] < w[1]), "in order, never two at once");
    let mean_gap = starts[3999] / 3999.0;
    assert!((mean_gap - 250.0).abs() < 15.0, "4 sessions/s: 250 ms apart on average, got {mean_gap}");
    let short = starts.windows(2).filter(|w| w[1] - w[0] < 250.0).count() as f64 / 3999.0;
    assert!((short - (1.0 - (-1.0f64).exp())).abs() < 0.03, "exponential gaps: {short}");
    assert!(trace.sessions.iter().all(|s| s[1].at_ms == 77.0 && s[1].delay_ms == 5.0), "think times stay");
}

#[test]
fn a_load_sweep_scales_arrivals_and_tabulates_every_rate() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.jsonl");
    let mut lines = String::new();
    for s in 0..4u64 {
        let first: Vec<u64> = (0..6).chain((100 * (s + 1))..(100 * (s + 1) + 2)).collect();
        lines.push_str(&format!(
            "{{\"session_id\":\"s{s}\",\"timestamp\":{},\"input_length\":{},\"output_length\":20,\"hash_ids\":{first:?}}}\n",
            s * 4000,
            first.len() * 512
        ));
        lines.push_str(&format!(
            "{{\"session_id\":\"s{s}\",\"input_length\":200,\"output_length\":20,\"hash_ids\":[{}],\"delay\":8000}}\n",
            9000 + s
        ));
    }
    std::fs::write(&path, lines).unwrap();
    let slow = ReplayArgs { load: vec![0.5], compare: vec![], ..args(path.clone()) };
    let fast = ReplayArgs { load: vec![4.0], ..slow.clone() };
    let (_, slow) = replay(&slow).unwrap();
    let (_, fast) = replay(&fast).unwrap();
    // 8 s of think time and 12 s of arrivals: at 8× the rate the trace is over far sooner.
    assert!(
        fast[0].virtual_time * 3 < slow[0].virtual_time,
        "{:?} vs {:?}",
        fast[0].virtual_time,
        slow[0].virtual_time
    );

    let sweep = ReplayArgs { load: vec![0.5, 2.0], json: Some(dir.path().join("sweep.json")), ..args(path) };
    let report = run(&sweep).unwrap();
    for row in ["0.5×  kv_aware", "0.5×  round_robin", "0.5×  random", "0.5×  baseline", "2×  kv_aware"] {
        assert!(report.contains(row), "no `{row}` row:\n{report}");
    }
    assert!(report.contains("baseline p50 ÷ KV-aware p50"), "{report}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("sweep.json")).unwrap()).unwrap();
    assert_eq!(json.as_array().map(Vec::len), Some(2), "one report per rate");
    assert_eq!(json[1]["load"], 2.0);
    // Of what the workers sustain: a saturating run measures the rate first, once.
    let capacity = ReplayArgs { load_of: LoadOf::Capacity, json: None, compare: vec![], ..sweep.clone() };
    let report = run(&capacity).unwrap();
    let line = report.lines().find(|l| l.starts_with("load is of what the workers sustain")).expect("the rate");
    let rate: f64 = line.split(": ").nth(1).and_then(|r| r.split(' ').next()).unwrap().parse().unwrap();
    assert!(rate.is_finite() && rate > 0.0, "{line}");
    let bad = ReplayArgs { load: vec![0.0], ..sweep.clone() };
    assert!(replay(&bad).is_err(), "a rate of 0 is refused");

    // The priority axis: the same trace with a fifth of the sessions' hints honoured.
    let priority = ReplayArgs { load: vec![1.0], json: None, compare: vec![Axis::Priority], ..sweep };
    let (_, outcomes) = replay(&priority).unwrap();
    let names: Vec<String> = outcomes.iter().map(|o| o.policy.name()).collect();
    assert_eq!(names[1], "kv_aware+retention+wt-g2g3+priorities", "{names:?}");
    assert_eq!(outcomes[1].samples.iter().filter(|s| s.high).count(), 2, "session 0 of 4, both its turns");
    let lines = comparisons(&outcomes);
    assert!(lines.iter().any(|l| l.starts_with("priority (a fifth")), "{lines:?}");
}

#[test]
fn the_reference_engine_replays_a_small_trace_in_real_time_on_the_real_node() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.jsonl");
    let mut lines = String::new();
    for s in 0..2u64 {
        lines.push_str(&format!(
            "{{\"session_id\":\"s{s}\",\"timestamp\":0,\"input_length\":700,\"output_length\":4,\"hash_ids\":[1,{}]}}\n",
            10 + s
        ));
        lines.push_str(&format!(
            "{{\"session_id\":\"s{s}\",\"input_length\":100,\"output_length\":4,\"hash_ids\":[{}],\"delay\":10}}\n",
            20 + s
        ));
    }
    std::fs::write(&path, lines).unwrap();
    let args =
        ReplayArgs { workers: 2, block_tokens: 32, compare: vec![], engine: ReplayEngine::Reference, ..args(path) };
    let (_, outcomes) = replay(&args).unwrap();
    assert_eq!(outcomes.len(), 1, "only the best configuration");
    let o = &outcomes[0];
    assert_eq!(o.samples.len(), 4);
    assert!(o.samples.iter().all(|s| s.ttft > Duration::ZERO && s.output > 0));
    // Each session's second turn finds its first turn's blocks; the two sessions share block 1.
    assert!(o.hit_rate(None) > 0.3, "{:?}", o.samples);
}

#[test]
fn two_nodes_load_each_others_g2_over_g4() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.jsonl");
    let mut lines = String::new();
    for s in 0..3u64 {
        let first: Vec<u64> = (100 * (s + 1)..100 * (s + 1) + 6).collect();
        lines.push_str(&format!(
            "{{\"session_id\":\"s{s}\",\"timestamp\":0,\"input_length\":{},\"output_length\":20,\"hash_ids\":{first:?}}}\n",
            first.len() * 512
        ));
        for t in 0..3u64 {
            lines.push_str(&format!(
                "{{\"session_id\":\"s{s}\",\"input_length\":200,\"output_length\":20,\"hash_ids\":[{}],\"delay\":500}}\n",
                10_000 + s * 10 + t
            ));
        }
    }
    std::fs::write(&path, lines).unwrap();
    let args = ReplayArgs { workers: 2, nodes: 2, ..args(path) };
    let (_, outcomes) = replay(&args).unwrap();
    let rr = outcomes.iter().find(|o| o.policy.routing == RoutingPolicy::RoundRobin).unwrap();
    // Three sessions over four workers: round-robin moves each session between workers.
    assert_eq!(rr.samples.len(), 12);
    let hits: Vec<PerTier<usize>> = rr.samples.iter().map(|s| s.hit).collect();
    assert!(
        rr.hit_rate(Some(TierName::G4)) > 0.0,
        "round-robin over two nodes loads some turns from the other node's G2: {hits:?}"
    );
    assert!(rr.bytes[4] > 0);
    let kv = &outcomes[0];
    assert!(
        kv.hit_rate(Some(TierName::G1)) > rr.hit_rate(Some(TierName::G1)),
        "KV-aware keeps sessions on their worker"
    );
}

#[test]
fn a_turn_waiting_for_room_in_the_cache_takes_an_idle_worker_at_once() {
    // Session `a` (or `a0` and `a1`) is routed at t = 0 and stays in the working set's line
    // for `router.session_gap` (60 s) after; a working set of a few hundred tokens leaves no
    // room behind it, so `b`, coming at t = 2 s, waits for room. With a worker idle and a G2
    // to load evicted contexts back from, `b` goes at once; with both workers decoding, or
    // without a G2, it waits until the line has room.
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tight.toml");
    std::fs::write(&config, "[router]\nworking_set = 0.0001\nsession_gap = \"60s\"\nadmission_max_wait = \"5m\"\n")
        .unwrap();
    let b_ttft = |busy: &[(&str, u64)], g2: ByteSize| {
        let path = dir.path().join("gap.jsonl");
        let mut lines = String::new();
        for (s, (name, output)) in busy.iter().enumerate() {
            let ids: Vec<u64> = (100 * (s as u64 + 1)..100 * (s as u64 + 1) + 8).collect();
            lines.push_str(&format!(
                "{{\"session_id\":\"{name}\",\"timestamp\":0,\"input_length\":4096,\"output_length\":{output},\"hash_ids\":{ids:?}}}\n"
            ));
        }
        lines.push_str(
            "{\"session_id\":\"b\",\"timestamp\":2000,\"input_length\":1024,\"output_length\":16,\"hash_ids\":[7,8]}\n",
        );
        std::fs::write(&path, lines).unwrap();
        let args = ReplayArgs { workers: 2, compare: Vec::new(), config: Some(config.clone()), g2, ..args(path) };
        let (_, outcomes) = replay(&args).unwrap();
        let kv = &outcomes[0];
        assert_eq!(kv.samples.len(), busy.len() + 1, "every request answered");
        kv.samples.iter().find(|s| s.prompt == 1024).expect("b's turn").ttft
    };
    // `a` answered its 16 tokens within a second: both workers are idle when `b` comes.
    let idle = b_ttft(&[("a", 16)], ByteSize(1 << 40));
    assert!(idle < Duration::from_secs(2), "an idle worker takes the waiting turn: {idle:?}");
    // 20,000 tokens of decode keep both workers busy past the 60 s `b` waits for room.
    let busy = b_ttft(&[("a0", 20_000), ("a1", 20_000)], ByteSize(1 << 40));
    assert!(busy > Duration::from_secs(30), "with both workers busy the turn waits for room: {busy:?}");
    // Without a G2 an evicted context is computed again: the turn waits even for idle workers.
    let unbacked = b_ttft(&[("a", 16)], ByteSize(0));
    assert!(unbacked > Duration::from_secs(30), "without a G2 the turn waits for room: {unbacked:?}");
}
