use super::*;

/// A model small enough to write to disk many times, with an embedding of more than one
/// [`CHUNK`] so that the parallel conversion splits a tensor.
const MICRO: ModelShape =
    ModelShape { name: "micro", layers: 2, hidden: 16, heads: 4, kv_heads: 2, head_dim: 4, ffn: 24, vocab: 70_000 };

fn bits(t: &HostTensor) -> Vec<u32> {
    t.data.iter().map(|x| x.to_bits()).collect()
}

fn assert_bitwise_eq(a: &HostWeights, b: &HostWeights) {
    assert_eq!(a.tensors.len(), b.tensors.len());
    for (name, t) in &a.tensors {
        let u = &b.tensors[name];
        assert_eq!(t.shape, u.shape, "{name}");
        assert!(bits(t) == bits(u), "{name} differs");
    }
}

/// Writes a safetensors file holding exactly `tensors` (name, dtype, shape, little-endian bytes).
fn write_tensors(path: &Path, tensors: &[(String, StDtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(&str, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| (name.as_str(), TensorView::new(*dtype, shape.clone(), bytes).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// The tensors of `w` in model order, as F32 files would hold them.
fn f32_tensors(w: &HostWeights) -> Vec<(String, StDtype, Vec<usize>, Vec<u8>)> {
    tensor_specs(&w.shape, !w.tensors.contains_key(LM_HEAD))
        .into_iter()
        .map(|(name, shape)| {
            let bytes = encode_all(Dtype::F32, &[&w.tensors[&name].data]).remove(0);
            (name, StDtype::F32, shape, bytes)
        })
        .collect()
}

fn saved_micro(dtype: Dtype) -> (tempfile::TempDir, HostWeights) {
    let dir = tempfile::tempdir().unwrap();
    let w = HostWeights::random(MICRO, 11);
    w.save_safetensors(dir.path(), dtype).unwrap();
    (dir, w)
}

fn rewrite_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let path = dir.join("config.json");
    let mut value: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(value.as_object_mut().unwrap());
    std::fs::write(&path, value.to_string()).unwrap();
}

#[test]
fn random_tiny_is_deterministic_and_complete() {
    let a = HostWeights::random(ModelShape::TINY, 42);
    let b = HostWeights::random(ModelShape::TINY, 42);
    assert_bitwise_eq(&a, &b);
    assert_eq!((a.rope_theta, a.rms_eps), (10_000.0, 1e-5));

    let specs = tensor_specs(&ModelShape::TINY, false);
    assert_eq!(a.tensors.len(), specs.len());
    assert_eq!(specs.len(), 1 + 9 * ModelShape::TINY.layers + 2);
    for (name, shape) in &specs {
        let t = &a.tensors[name];
        assert_eq!(&t.shape, shape, "{name}");
        assert_eq!(t.data.len(), shape.iter().product::<usize>(), "{name}");
        if shape.len() == 1 {
            assert!(t.data.iter().all(|&x| x == 1.0), "{name}: norm weights are 1");
            continue;
        }
        let bound = if name == EMBED_TOKENS { 3f32.sqrt() } else { (3.0 / shape[1] as f32).sqrt() };
        assert!(t.data.iter().all(|x| x.abs() <= bound), "{name}: outside ±{bound}");
        // Uniform in ±b: mean 0, variance b²/3.
        let n = t.data.len() as f64;
        let mean = t.data.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
        let var = t.data.iter().map(|&x| (f64::from(x) - mean).powi(2)).sum::<f64>() / n;
        let want = f64::from(bound).powi(2) / 3.0;
        assert!(mean.abs() < 0.05 * f64::from(bound), "{name}: mean {mean}");
        assert!((var / want - 1.0).abs() < 0.05, "{name}: variance {var}, expected {want}");
    }
    let (q, k) =
        (&a.tensors["model.layers.0.self_attn.q_proj.weight"], &a.tensors["model.layers.0.self_attn.k_proj.weight"]);
    assert_eq!(q.rows_cols(), (128, 128));
    assert_eq!(k.rows_cols(), (64, 128));
    assert_eq!(a.tensors[FINAL_NORM].rows_cols(), (1, 128));
    assert_ne!(q.data[..64], k.data[..64], "tensors get independent streams");
    assert_eq!(a.num_params(), specs.iter().map(|(_, s)| s.iter().product::<usize>()).sum::<usize>());

    let c = HostWeights::random(ModelShape::TINY, 43);
    assert_ne!(bits(&a.tensors[EMBED_TOKENS]), bits(&c.tensors[EMBED_TOKENS]), "another seed, other weights");
}

#[test]
fn random_is_chunk_seeded() {
    // Recomputes the embedding one chunk after another, on one thread: equal to what the parallel
    // fill produced, so the result cannot depend on the number of threads.
    let w = HostWeights::random(MICRO, 5);
    let embed = &w.tensors[EMBED_TOKENS];
    assert!(embed.data.len() > CHUNK);
    let mut expected = vec![0.0; embed.data.len()];
    let tensor_seed = splitmix64(5 ^ fnv1a(EMBED_TOKENS.as_bytes()));
    for (i, chunk) in expected.chunks_mut(CHUNK).enumerate() {
        fill_uniform(chunk, splitmix64(tensor_seed.wrapping_add(i as u64)), 3f32.sqrt());
    }
    assert!(embed.data.iter().zip(&expected).all(|(a, b)| a.to_bits() == b.to_bits()));
}

#[test]
fn random_rope_theta_by_shape() {
    // Generating llama-1b here would be slow in a debug build; its parts are checked instead.
    assert_eq!(random_rope_theta(ModelShape::LLAMA_1B.name), 500_000.0);
    assert_eq!(random_rope_theta(ModelShape::LLAMA_8B.name), 500_000.0);
    assert_eq!(random_rope_theta(ModelShape::TINY.name), 10_000.0);
    assert_eq!(HostWeights::random(MICRO, 1).rope_theta, 10_000.0);
    let params: usize =
        tensor_specs(&ModelShape::LLAMA_1B, true).iter().map(|(_, s)| s.iter().product::<usize>()).sum();
    assert_eq!(params, 1_235_814_400, "Llama 3.2 1B");
}

#[test]
fn f32_round_trip_is_exact() {
    let (dir, w) = saved_micro(Dtype::F32);
    let loaded = HostWeights::load(dir.path()).unwrap();
    assert_eq!(loaded.shape, ModelShape { name: loaded.shape.name, ..MICRO });
    assert_eq!(loaded.shape.name, dir.path().display().to_string());
    assert_eq!((loaded.rope_theta, loaded.rms_eps), (w.rope_theta, w.rms_eps));
    assert_bitwise_eq(&loaded, &HostWeights { shape: loaded.shape, ..w });
}

#[test]
fn half_round_trips_match_half_rounding() {
    for dtype in [Dtype::Bf16, Dtype::F16] {
        let (dir, w) = saved_micro(dtype);
        let st_dtype = {
            let bytes = std::fs::read(dir.path().join("model.safetensors")).unwrap();
            SafeTensors::deserialize(&bytes).unwrap().tensor(EMBED_TOKENS).unwrap().dtype()
        };
        assert_eq!(st_dtype, if dtype == Dtype::Bf16 { StDtype::BF16 } else { StDtype::F16 });
        let loaded = HostWeights::load(dir.path()).unwrap();
        let (mut max_rel, mut changed) = (0f32, 0usize);
        for (name, t) in &w.tensors {
            let got = &loaded.tensors[name];
            for (&x, &y) in t.data.iter().zip(&got.data) {
                let rounded = match dtype {
                    Dtype::Bf16 => half::bf16::from_f32(x).to_f32(),
                    _ => half::f16::from_f32(x).to_f32(),
                };
                assert_eq!(y.to_bits(), rounded.to_bits(), "{dtype:?} {name}: {x} loaded as {y}");
                changed += usize::from(x != y);
                if x.abs() > 1e-3 {
                    max_rel = max_rel.max(((x - y) / x).abs());
                }
            }
        }
        // Half the unit in the last place: 2^-8 for bf16, 2^-11 for f16.
        let bound = if dtype == Dtype::Bf16 { 1.0 / 256.0 } else { 1.0 / 2048.0 };
        assert!(max_rel <= bound, "{dtype:?}: relative error {max_rel}");
        assert!(changed > 0, "{dtype:?}: random f32 values do round");
    }
}

#[test]
fn tied_embeddings_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = HostWeights::random(MICRO, 3);
    w.tensors.remove(LM_HEAD);
    w.save_safetensors(dir.path(), Dtype::F32).unwrap();
    assert!(read_hf_config(dir.path()).unwrap().tie_word_embeddings);
    let loaded = HostWeights::load(dir.path()).unwrap();
    assert!(!loaded.tensors.contains_key(LM_HEAD));
    assert_eq!(bits(loaded.lm_head()), bits(&w.tensors[EMBED_TOKENS]));

    // A tied checkpoint that also stores lm_head.weight loads without it.
    let (dir, _) = saved_micro(Dtype::F32);
    rewrite_config(dir.path(), |c| {
        c.insert("tie_word_embeddings".into(), true.into());
    });
    let loaded = HostWeights::load(dir.path()).unwrap();
    assert!(!loaded.tensors.contains_key(LM_HEAD));
}

#[test]
fn sharded_checkpoint_loads() {
    let dir = tempfile::tempdir().unwrap();
    let w = HostWeights::random(MICRO, 9);
    w.save_safetensors(dir.path(), Dtype::F32).unwrap();
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let all = f32_tensors(&w);
    let (first, second) = all.split_at(all.len() / 2);
    let names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"];
    write_tensors(&dir.path().join(names[0]), first);
    write_tensors(&dir.path().join(names[1]), second);
    let weight_map: serde_json::Map<String, serde_json::Value> = first
        .iter()
        .map(|t| (t.0.clone(), names[0].into()))
        .chain(second.iter().map(|t| (t.0.clone(), names[1].into())))
        .collect();
    let index = serde_json::json!({ "metadata": { "total_size": 0 }, "weight_map": weight_map });
    std::fs::write(dir.path().join("model.safetensors.index.json"), index.to_string()).unwrap();
    // A stray file that the index does not name is not read.
    std::fs::write(dir.path().join("consolidated.safetensors"), b"not safetensors").unwrap();

    let loaded = HostWeights::load(dir.path()).unwrap();
    assert_bitwise_eq(&loaded, &HostWeights { shape: loaded.shape, ..w.clone() });

    // Without the index, every *.safetensors is read: here the stray file is an error.
    std::fs::remove_file(dir.path().join("model.safetensors.index.json")).unwrap();
    let err = HostWeights::load(dir.path()).unwrap_err();
    assert_eq!(err.kind(), "safetensors");
    assert!(err.to_string().contains("consolidated.safetensors"), "{err}");
    // Without it, the two shards load.
    std::fs::remove_file(dir.path().join("consolidated.safetensors")).unwrap();
    let loaded = HostWeights::load(dir.path()).unwrap();
    assert_bitwise_eq(&loaded, &HostWeights { shape: loaded.shape, ..w });
}

#[test]
fn index_naming_a_missing_shard_is_an_error() {
    let (dir, _) = saved_micro(Dtype::F32);
    let index = serde_json::json!({ "weight_map": { EMBED_TOKENS: "model-00002-of-00002.safetensors" } });
    std::fs::write(dir.path().join("model.safetensors.index.json"), index.to_string()).unwrap();
    let err = HostWeights::load(dir.path()).unwrap_err();
    assert_eq!(err.kind(), "index");
    let msg = err.to_string();
    assert!(msg.contains("model.safetensors.index.json") && msg.contains("model-00002-of-00002"), "{msg}");
}

#[test]
fn duplicate_tensor_is_an_error() {
    let (dir, w) = saved_micro(Dtype::F32);
    let norm = f32_tensors(&w).into_iter().filter(|t| t.0 == FINAL_NORM).collect::<Vec<_>>();
    write_tensors(&dir.path().join("extra.safetensors"), &norm);
    let err = HostWeights::load(dir.path()).unwrap_err();
    assert_eq!(err.kind(), "duplicate_tensor");
    let msg = err.to_string();
    assert!(
        msg.contains(FINAL_NORM) && msg.contains("extra.safetensors") && msg.contains("model.safetensors"),
        "{msg}"
    );
}

#[test]
fn missing_tensor_is_an_error() {
    let (dir, w) = saved_micro(Dtype::F32);
    let gone = "model.layers.1.self_attn.v_proj.weight";
    let mut tensors = f32_tensors(&w);
    tensors.retain(|t| t.0 != gone);
    // Tensors the model does not use are ignored.
    tensors.push(("model.layers.0.self_attn.rotary_emb.inv_freq".into(), StDtype::I64, vec![2], vec![0; 16]));
    write_tensors(&dir.path().join("model.safetensors"), &tensors);
    let err = HostWeights::load(dir.path()).unwrap_err();
    assert_eq!(err.kind(), "missing_tensor");
    let msg = err.to_string();
    assert!(msg.contains(gone) && msg.contains("model.safetensors"), "{msg}");
}

#[test]
fn wrong_shape_is_an_error() {
    let (dir, _) = saved_micro(Dtype::Bf16);
    rewrite_config(dir.path(), |c| {
        c.insert("intermediate_size".into(), 32.into());
    });
    let err = HostWeights::load(dir.path()).unwrap_err();
    assert_eq!(err.kind(), "tensor_shape");
    let msg = err.to_string();
    assert!(
        msg.contains("model.safetensors")
            && msg.contains("model.layers.0.mlp.gate_proj.weight")
            && msg.contains("[24, 16]")
            && msg.contains("expected [32, 16]"),
        "{msg}"
    );
    assert!(
        matches!(err, WeightsError::TensorShape { expected, found, .. } if expected == [32, 16] && found == [24, 16])
    );
}

#[test]
fn unsupported_dtype_is_an_error() {
    let (dir, w) = saved_micro(Dtype::F32);
    let mut tensors = f32_tensors(&w);
    let norm = tensors.iter_mut().find(|t| t.0 == "model.layers.1.post_attention_layernorm.weight").unwrap();
    norm.1 = StDtype::I64;
    norm.3 = vec![0; 16 * 8];
    write_tensors(&dir.path().join("model.safetensors"), &tensors);
    let err = HostWeights::load(dir.path()).unwrap_err();
    assert_eq!(err.kind(), "unsupported_dtype");
    let msg = err.to_string();
    assert!(
        msg.contains("I64") && msg.contains("post_attention_layernorm") && msg.contains("model.safetensors"),
        "{msg}"
    );
}

#[test]
fn config_errors_name_the_key() {
    let (dir, _) = saved_micro(Dtype::F32);
    rewrite_config(dir.path(), |c| {
        c.remove("vocab_size");
    });
    let err = HostWeights::load(dir.path()).unwrap_err();
    assert!(matches!(err, WeightsError::MissingConfigKey { key: "vocab_size", .. }), "{err:?}");
    assert_eq!(err.kind(), "missing_config_key");
    assert!(err.to_string().contains("config.json: missing key `vocab_size`"), "{err}");

    rewrite_config(dir.path(), |c| {
        c.insert("vocab_size".into(), "many".into());
    });
    let err = read_hf_config(dir.path()).unwrap_err();
    assert_eq!(err.kind(), "json");
    assert!(err.to_string().contains("invalid type"), "{err}");

    rewrite_config(dir.path(), |c| {
        c.insert("vocab_size".into(), 70_000.into());
        c.insert("num_key_value_heads".into(), 3.into());
    });
    let err = read_hf_config(dir.path()).unwrap_err();
    assert_eq!(err.kind(), "invalid_config");
    assert!(err.to_string().contains("not a multiple of num_key_value_heads (3)"), "{err}");

    std::fs::write(dir.path().join("config.json"), "{ not json").unwrap();
    assert_eq!(read_hf_config(dir.path()).unwrap_err().kind(), "json");
    std::fs::remove_file(dir.path().join("config.json")).unwrap();
    let err = HostWeights::load(dir.path()).unwrap_err();
    assert_eq!(err.kind(), "io");
    assert!(err.to_string().contains("config.json"), "{err}");
}

#[test]
fn config_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let config = serde_json::json!({
        "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 8,
        "intermediate_size": 100, "vocab_size": 1000, "torch_dtype": "bfloat16",
    });
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    let c = read_hf_config(dir.path()).unwrap();
    assert_eq!((c.num_key_value_heads, c.head_dim), (8, 8));
    assert_eq!((c.rope_theta, c.rms_norm_eps, c.tie_word_embeddings), (10_000.0, 1e-5, false));
    assert_eq!(
        c.shape("x"),
        ModelShape { name: "x", layers: 3, hidden: 64, heads: 8, kv_heads: 8, head_dim: 8, ffn: 100, vocab: 1000 }
    );

    let config = serde_json::json!({
        "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 100, "vocab_size": 1000, "rope_parameters": { "rope_theta": 500000.0 },
        "rms_norm_eps": 1e-6, "tie_word_embeddings": true,
    });
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    let c = read_hf_config(dir.path()).unwrap();
    assert_eq!((c.num_key_value_heads, c.head_dim), (2, 16));
    assert_eq!((c.rope_theta, c.rms_norm_eps, c.tie_word_embeddings), (500_000.0, 1e-6, true));

    let err = HostWeights::load(dir.path()).unwrap_err();
    assert_eq!(err.kind(), "no_weight_files");
}

#[test]
fn save_refuses_inconsistent_weights() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = HostWeights::random(MICRO, 2);
    w.tensors.remove("model.layers.0.mlp.up_proj.weight");
    let err = w.save_safetensors(dir.path(), Dtype::F32).unwrap_err();
    assert_eq!(err.kind(), "inconsistent");
    assert!(err.to_string().contains("model.layers.0.mlp.up_proj.weight"), "{err}");
}

/// Llama 3.1's scaled RoPE frequencies, bit for bit as `transformers` 5.19 computes them
/// (`ROPE_INIT_FUNCTIONS["llama3"]` for head_dim 128, theta 500000, factor 8, low 1, high 4,
/// original context 8192).
#[test]
fn llama3_rope_scaling_matches_transformers_bitwise() {
    const TRANSFORMERS: [u32; 64] = [
        0x3f800000, 0x3f508ac1, 0x3f29e1c6, 0x3f0a6384, 0x3ee177bc, 0x3eb7ab7d, 0x3e959ee3, 0x3e73c461, 0x3e4693b0,
        0x3e21c3a0, 0x3e03c6a0, 0x3dd6b19c, 0x3daee4ad, 0x3d8e7898, 0x3d681e67, 0x3d3d1684, 0x3d1a08c8, 0x3cfaf53f,
        0x3ccc6f49, 0x3ca68939, 0x3c87a9c3, 0x3c5d06ec, 0x3c340d6d, 0x3c12ac7f, 0x3beef74f, 0x3bc2aa76, 0x3b9e9402,
        0x3b812e35, 0x3b527720, 0x3b0dfd06, 0x3ab3d11d, 0x3a60979e, 0x3a0995d2, 0x39a3f108, 0x393b2dd2, 0x38c86886,
        0x38a3418d, 0x3884fdbf, 0x3858ac81, 0x38308199, 0x380fc8f8, 0x37ea426f, 0x37bed4f4, 0x379b7475, 0x377d45c3,
        0x374e51f5, 0x3728126b, 0x3708ea0f, 0x36df10c4, 0x36b5b687, 0x369406cb, 0x36712b80, 0x36447610, 0x36200a69,
        0x36025f34, 0x35d46808, 0x35ad07a7, 0x358cf400, 0x3565a54d, 0x353b12c7, 0x351864a7, 0x34f848c2, 0x34ca41b0,
        0x34a4c2ff,
    ];
    let dir = tempfile::tempdir().unwrap();
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 1, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 100, "vocab_size": 1000,
        "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
    });
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    let c = read_hf_config(dir.path()).unwrap();
    assert!(matches!(c.rope_scaling, RopeScaling::Llama3 { factor: 8.0, .. }), "{:?}", c.rope_scaling);
    let got: Vec<u32> = c.rope_scaling.inv_freq(c.rope_theta, c.head_dim).iter().map(|f| f.to_bits()).collect();
    assert_eq!(got, TRANSFORMERS);
}

/// Each supported architecture reads as its variant; the ones the engine cannot compute are
/// refused at once with their name and a pointer to an engine that can.
#[test]
fn architectures_are_read_or_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let read = |extra: serde_json::Value| {
        let mut config = serde_json::json!({
            "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 128, "vocab_size": 500,
        });
        config.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
        read_hf_config(dir.path())
    };
    let variant = |extra| read(extra).unwrap().variant;
    assert_eq!(variant(serde_json::json!({"architectures": ["LlamaForCausalLM"]})), Variant::default());
    assert_eq!(variant(serde_json::json!({"model_type": "mistral"})), Variant::default());
    assert_eq!(
        variant(serde_json::json!({"architectures": ["LlamaForCausalLM"], "attention_bias": true})),
        Variant { qkv_bias: true, o_bias: true, qk_norm: false }
    );
    assert_eq!(
        variant(serde_json::json!({"architectures": ["Qwen2ForCausalLM"]})),
        Variant { qkv_bias: true, ..Variant::default() }
    );
    assert_eq!(
        variant(serde_json::json!({"architectures": ["Qwen3ForCausalLM"], "head_dim": 32})),
        Variant { qk_norm: true, ..Variant::default() }
    );
    let c = read(serde_json::json!({"architectures": ["MistralForCausalLM"], "sliding_window": 4096})).unwrap();
    assert_eq!(c.sliding_window, Some(4096));
    let c = read(serde_json::json!({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096,
                                     "use_sliding_window": false}))
    .unwrap();
    assert_eq!(c.sliding_window, None, "Qwen's window is off unless use_sliding_window");
    let c =
        read(serde_json::json!({"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 10000.0})).unwrap();
    assert_eq!(c.rope_scaling.inv_freq(c.rope_theta, 16)[1], crate::backend::rope_inv_freq(10000.0, 16)[1] / 2.0);

    for (extra, names) in [
        (serde_json::json!({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8}), "Qwen3MoeForCausalLM"),
        (serde_json::json!({"architectures": ["DeepseekV3ForCausalLM"]}), "DeepseekV3ForCausalLM"),
        (serde_json::json!({"architectures": ["MixtralForCausalLM"]}), "MixtralForCausalLM"),
        (serde_json::json!({"architectures": ["LlamaForCausalLM"], "hidden_act": "gelu"}), "hidden_act"),
        (serde_json::json!({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}), "yarn"),
        (serde_json::json!({"model_type": "gemma3"}), "gemma3"),
    ] {
        let err = read(extra).unwrap_err().to_string();
        assert!(err.contains(names) && err.contains("config.json") && err.contains("vLLM"), "{err}");
    }
    let err = read(serde_json::json!({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}})).unwrap_err();
    assert!(err.to_string().contains("low_freq_factor"), "{err}");
}
