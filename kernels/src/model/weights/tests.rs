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
