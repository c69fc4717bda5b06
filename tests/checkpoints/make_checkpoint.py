#!/usr/bin/env python3
"""Makes a tiny random checkpoint of a real model family, plus reference outputs.

    python make_checkpoint.py ARCH DIR [--seed 0]      # ARCH: llama, qwen2, qwen3, mistral
    python make_checkpoint.py --selfcheck [ROOT]       # all four into ROOT/{arch}, with a summary

What and why: the server must serve a real-format checkpoint token-for-token like `transformers`.
Real checkpoints are gigabytes; this makes one of a few hundred kilobytes that has every real
part: a `tokenizer.json` trained here (byte-level BPE for Llama 3 and Qwen, SentencePiece-style BPE
with byte fallback for Mistral) with the family's added tokens and their `special` flags, the
family's official chat template (`templates/*.jinja`, written by transformers 5 as
`chat_template.jinja`), a random model of the family's transformers class saved in bfloat16
safetensors, and a `generation_config.json` like the real one. Everything is saved by
`transformers` itself (`save_pretrained`), so the files are exactly what transformers 5 writes.

To exercise stopping, the row of the family's end-of-turn token in `lm_head` is swapped with the
row of the token the model would greedily emit 6th for the "plain" conversation, so that greedy
decoding of "plain" ends with that token by step 6.

`reference.json` then holds, per conversation (OpenAI wire form), the prompt ids from
`apply_chat_template`, the greedy continuation from `generate` (float32, reloaded from DIR, at
most 32 new tokens, stopping at the generation config's eos ids, the eos included), its decoded
text and the float32 logits at the last prompt position. `special.json` lists the special and
the added-but-not-special token ids. Same seed, same files.
"""

import argparse
import copy
import json
import os
import random
import sys

import torch
from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors,
                        trainers)

QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

HERE = os.path.dirname(os.path.abspath(__file__))
MAX_NEW_TOKENS = 32
SWAP_STEP = 5  # 0-based: the 6th generated token of "plain" becomes the end-of-turn token

# Per family: added tokens in id order (content, special), the tokenizer's bos/eos/pad/unk, the
# end-of-turn token, generation_config.json and config.json specifics.
FAMILIES = {
    "llama": dict(
        added=[("<|begin_of_text|>", True), ("<|end_of_text|>", True), ("<|start_header_id|>", True),
               ("<|end_header_id|>", True), ("<|eom_id|>", True), ("<|eot_id|>", True), ("<|python_tag|>", True)],
        bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None, unk=None, end_of_turn="<|eot_id|>",
        gen=dict(eos=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], bos=True, do_sample=True,
                 temperature=0.6, top_p=0.9),
        config_eos=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]),
    "qwen2": dict(
        added=[("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
               ("<tool_call>", False), ("</tool_call>", False)],
        bos=None, eos="<|im_end|>", pad="<|endoftext|>", unk=None, end_of_turn="<|im_end|>",
        gen=dict(eos=["<|im_end|>", "<|endoftext|>"], bos=True, pad=True, do_sample=True, temperature=0.7,
                 top_p=0.8, top_k=20, repetition_penalty=1.05),
        config_eos="<|im_end|>"),
    "qwen3": dict(
        added=[("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
               ("<tool_call>", False), ("</tool_call>", False), ("<tool_response>", False),
               ("</tool_response>", False), ("<think>", False), ("</think>", False)],
        bos=None, eos="<|im_end|>", pad="<|endoftext|>", unk=None, end_of_turn="<|im_end|>",
        gen=dict(eos=["<|im_end|>", "<|endoftext|>"], bos=True, pad=True, do_sample=True, temperature=0.6,
                 top_k=20, top_p=0.95),
        config_eos="<|im_end|>"),
    "mistral": dict(
        added=[("<unk>", True), ("<s>", True), ("</s>", True), ("[INST]", True), ("[/INST]", True),
               ("[TOOL_CALLS]", True), ("[AVAILABLE_TOOLS]", True), ("[/AVAILABLE_TOOLS]", True),
               ("[TOOL_RESULTS]", True), ("[/TOOL_RESULTS]", True)],
        bos="<s>", eos="</s>", pad=None, unk="<unk>", end_of_turn="</s>",
        gen=dict(eos="</s>", bos=True),
        config_eos="</s>"),
}
# bos_token_id in configs: the tokenizer's bos, or <|endoftext|> for Qwen (as the real configs).
CONFIG_BOS = {"llama": "<|begin_of_text|>", "qwen2": "<|endoftext|>", "qwen3": "<|endoftext|>", "mistral": "<s>"}

# ---------------------------------------------------------------------------------------------
# Conversations (OpenAI Chat wire form)
# ---------------------------------------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Get the local time in a time zone.",
        "parameters": {"type": "object", "properties": {
            "timezone": {"type": "string", "description": "An IANA time zone, e.g. Europe/Paris"}},
            "required": ["timezone"]}}},
]
CALL_ID = "a1B2c3D4e"  # Mistral's template requires 9 alphanumerics


def tool_call_turn(content, reasoning=None):
    msg = {"role": "assistant", "content": content,
           "tool_calls": [{"id": CALL_ID, "type": "function", "function": {
               "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    return msg


def cases(arch):
    """(name, messages, tools, chat_template_kwargs) for the family."""
    system = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}
    ask = {"role": "user", "content": "What is the capital of France?"}
    weather = {"role": "user", "content": "What is the weather like in Paris today?"}
    result = {"role": "tool", "tool_call_id": CALL_ID, "content": json.dumps({"temperature": 22, "sky": "sunny"})}
    # Qwen3's release template reads the assistant's content as a string ('</think>' in content),
    # so its tool-call turn carries "" where the other families' carry null.
    empty = "" if arch == "qwen3" else None
    out = [
        ("plain", [system, ask], None, None),
        ("no_system", [ask], None, None),
        ("tools", [system, weather], TOOLS, None),
        ("tool_result", [weather, tool_call_turn(empty), result], TOOLS, None),
        ("multi_turn", [{"role": "user", "content": "Hello! Who are you?"},
                        {"role": "assistant", "content": "I am a helpful assistant."},
                        {"role": "user", "content": "Name three colors."},
                        {"role": "assistant", "content": "Red, green and blue."},
                        {"role": "user", "content": "And two more, please."}], None, None),
    ]
    if arch == "qwen3":
        out += [
            ("reasoning", [{"role": "user", "content": "What is two plus two?"},
                           {"role": "assistant", "content": "Two plus two is four.",
                            "reasoning_content": "The user asks for 2 + 2, which is 4."},
                           {"role": "user", "content": "And three plus three?"}], None, None),
            ("reasoning_tool", [weather, tool_call_turn("", reasoning="The user wants the weather; call get_weather."),
                                result], TOOLS, None),
            ("no_thinking", [system, ask], None, {"enable_thinking": False}),
        ]
    return out


def to_hf(messages):
    """Wire form -> what HF templates expect: tool-call arguments as objects."""
    out = copy.deepcopy(messages)
    for m in out:
        for tc in m.get("tool_calls") or []:
            tc["function"]["arguments"] = json.loads(tc["function"]["arguments"])
    return out


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

WORDS = """
the a an of to and in is it you that for on with as be at this have from or by one had not but what all were
when we there can your which their said if do will each about how up out them then she many some so these
would other into has more her two like him see time could no make than first been its who now people my made
over did down only way find use may water long little very after words called just where most know get
through back much before go good new write our used me man too any day same right look think also around
another came come work three word must because does part even place well such here take why things help put
years different away again off went old number great tell men say small every found still between name
should home big give air line set own under read last never us left end along while might next sound below
saw something thought both few those always looked show large often together asked house world going want
school important until form food keep children feet land side without boy once animal life enough took four
head above kind began almost live page got earth need far hand high year mother light country father let
night picture being study second soon story since white ever paper hard near sentence better best across
during today however sure knew try told young sun thing whole hear example heard several change answer room
sea against top turned learn point city play toward five himself usually money seen car morning weather
capital France Paris London Berlin Tokyo sunny cloudy rain temperature celsius fahrenheit time zone color
red green blue yellow assistant user system tool function call result question helpful briefly
""".split()


def corpus(arch, seed, prompts=()):
    """Synthetic English-like text: sentences, numbers, JSON, the template, the test texts and (the
    second time) the rendered test prompts, so that those tokenize compactly as with a real vocab."""
    rng = random.Random(seed)
    lines = []
    for _ in range(4000):
        n = rng.randint(4, 14)
        words = [rng.choice(WORDS) for _ in range(n)]
        words[0] = words[0].capitalize()
        s = " ".join(words) + rng.choice([".", ".", "?", "!", ",", ":"])
        if rng.random() < 0.3:
            s += " " + str(rng.randint(0, 10 ** rng.randint(1, 5)))
        lines.append(s)
    for _ in range(800):
        obj = {rng.choice(WORDS): rng.choice([rng.randint(0, 999), rng.choice(WORDS), True, None, [1, 2]])
               for _ in range(rng.randint(1, 4))}
        lines.append(json.dumps(obj, indent=rng.choice([None, 4])))
    lines.append(open(os.path.join(HERE, "templates", arch + ".jinja")).read())
    for tool in TOOLS:
        lines += [json.dumps(tool), json.dumps(tool, indent=4), json.dumps(tool["function"])]
    for _, messages, _, _ in cases(arch):
        lines += [m.get("content") or "" for m in messages]
    lines.append("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 {}[]():;,.\"'!?-_/\\|<>=+*&%$#@~`^")
    lines.append("Cutting Knowledge Date: December 2023 Today Date: 26 Jul 2024 Environment: ipython")
    for prompt in prompts:
        for content, _ in FAMILIES[arch]["added"]:
            prompt = prompt.replace(content, "\n")
        lines += [prompt] * 8
    text = "\n".join(lines)
    if arch == "mistral":  # like the real one: no newline piece, so "\n" goes through byte fallback
        text = text.replace("\n", " ").replace("\t", " ")
    return [text[i:i + 2000] for i in range(0, len(text), 2000)]


def build_tokenizer(arch, seed):
    """Trains twice: the second time also on the test prompts as the first tokenizer renders them."""
    first = train_tokenizer(arch, corpus(arch, seed))
    prompts = [first.apply_chat_template(to_hf(m), tools=t, add_generation_prompt=True, tokenize=False, **(k or {}))
               for _, m, t, k in cases(arch)]
    return train_tokenizer(arch, corpus(arch, seed, prompts))


def train_tokenizer(arch, texts):
    fam = FAMILIES[arch]
    if arch == "mistral":
        # Train on words (Metaspace split), then lay the vocab out like the real one: the control
        # tokens first, then the 256 byte-fallback pieces, then the learned pieces.
        trainer_tok = Tokenizer(models.BPE(unk_token="<unk>"))
        trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
        trainer_tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=1200, show_progress=False))
        learned = json.loads(trainer_tok.to_str())["model"]
        vocab = {content: i for i, (content, _) in enumerate(fam["added"])}
        for b in range(256):
            vocab["<0x%02X>" % b] = len(vocab)
        for piece, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
            vocab.setdefault(piece, len(vocab))
        merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
        # As transformers 5 builds LlamaTokenizer (legacy=False): Metaspace "first", no split.
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1)])
    else:
        tok = Tokenizer(models.BPE())
        if arch.startswith("qwen"):
            tok.normalizer = normalizers.NFC()
        # The split the real tokenizers make before their byte-level BPE (transformers 5 rebuilds
        # Qwen2Tokenizer and the Llama 3 tokenizer with these patterns whatever tokenizer.json says).
        pattern = QWEN_SPLIT if arch.startswith("qwen") else LLAMA3_SPLIT
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(texts, trainers.BpeTrainer(
            vocab_size=1400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    for content, special in fam["added"]:
        added = AddedToken(content, special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([added])
    if fam["bos"]:  # Llama 3 and Mistral prepend BOS on plain encodes (templates write it themselves)
        bos_id = tok.token_to_id(fam["bos"])
        tok.post_processor = processors.TemplateProcessing(
            single=f"{fam['bos']} $A", pair=f"{fam['bos']} $A {fam['bos']} $B", special_tokens=[(fam["bos"], bos_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=fam["bos"], eos_token=fam["eos"],
                                   pad_token=fam["pad"], unk_token=fam["unk"])
    fast.chat_template = open(os.path.join(HERE, "templates", arch + ".jinja")).read()
    return fast


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------

DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 1000000.0}
MODELS = {  # config class, model class, the family's own settings (as the real configs)
    "llama": (LlamaConfig, LlamaForCausalLM, dict(
        rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(
        rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=True, rope_parameters=DEFAULT_ROPE)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(  # head_dim 32 != hidden / heads
        head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=False,
        rope_parameters=DEFAULT_ROPE)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(
        rms_norm_eps=1e-5, max_position_embeddings=32768, sliding_window=None, tie_word_embeddings=False,
        rope_parameters=DEFAULT_ROPE)),
}


def build_model(arch, tokenizer, seed):
    fam, ids = FAMILIES[arch], tokenizer.convert_tokens_to_ids
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.2,
                  bos_token_id=ids(CONFIG_BOS[arch]), pad_token_id=ids(fam["pad"]) if fam["pad"] else None,
                  eos_token_id=[ids(t) for t in fam["config_eos"]] if isinstance(fam["config_eos"], list)
                  else ids(fam["config_eos"]))
    config_class, model_class, specifics = MODELS[arch]
    torch.manual_seed(seed)
    model = model_class(config_class(**{**common, **specifics}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):  # Qwen2's q/k/v biases: make them matter
                torch.nn.init.normal_(p, std=0.5)
            elif "norm" in name:  # RMSNorm weights: around 1, not all 1
                torch.nn.init.normal_(p, mean=1.0, std=0.1)
        # Round the weights (not the rotary buffers) to bfloat16 now, so that what is generated here
        # is what the saved model generates.
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    model.eval()
    model.generation_config = generation_config(arch, tokenizer)
    return model


def generation_config(arch, tokenizer):
    g, ids = dict(FAMILIES[arch]["gen"]), tokenizer.convert_tokens_to_ids
    eos = [ids(t) for t in g.pop("eos")] if isinstance(g["eos"], list) else ids(g.pop("eos"))
    if g.pop("bos"):
        g["bos_token_id"] = ids(CONFIG_BOS[arch])
    if g.pop("pad", False):
        g["pad_token_id"] = ids(FAMILIES[arch]["pad"])
    return GenerationConfig(eos_token_id=eos, **g)


def swap_end_of_turn(arch, model, tokenizer):
    """Swaps lm_head rows: the 6th greedy token of "plain" <-> the end-of-turn token, so that "plain"
    ends by step 6. Where the head is tied to the embeddings (Qwen2) a swap also changes the prompt
    (which holds <|im_end|>) and so what follows; then, if that token does not do it, the other
    tokens are tried in turn (the earlier generated ones, then by id), preferring one with which
    "plain" says something (3 to 6 tokens) before it stops. Returns (eot, partner)."""
    _, messages, tools, kwargs = cases(arch)[0]
    ids = prompt_ids(tokenizer, messages, tools, kwargs)
    eot = tokenizer.convert_tokens_to_ids(FAMILIES[arch]["end_of_turn"])
    out, _ = greedy(model, ids, eos=None, pad=0, n=SWAP_STEP + 1)
    if eot in out:
        return eot, None
    head = model.get_output_embeddings().weight
    specials = set(tokenizer.all_special_ids)
    fallback = None
    for tok in dict.fromkeys(out[::-1] + list(range(head.shape[0]))):
        if tok in specials:
            continue
        with torch.no_grad():
            head[[tok, eot]] = head[[eot, tok]]
        after = greedy(model, ids, eos=None, pad=0, n=SWAP_STEP + 1)[0]
        with torch.no_grad():
            head[[tok, eot]] = head[[eot, tok]]
        if eot in after[2:] and eot not in after[:2]:
            fallback = tok
            break
        if eot in after and fallback is None:
            fallback = tok
    if fallback is None:
        raise RuntimeError(f"{arch}: no swap makes \"plain\" stop by step {SWAP_STEP + 1}")
    with torch.no_grad():
        head[[fallback, eot]] = head[[eot, fallback]]
    return eot, fallback


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def prompt_ids(tokenizer, messages, tools, kwargs):
    enc = tokenizer.apply_chat_template(to_hf(messages), tools=tools, add_generation_prompt=True, tokenize=True,
                                        **(kwargs or {}))
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)  # transformers 5: a BatchEncoding


def greedy(model, ids, eos, pad, n=MAX_NEW_TOKENS, penalty=1.0):
    """Greedy `generate` with the model's repetition penalty (what `generate(do_sample=False)` takes
    from generation_config.json, and what vLLM applies by default); returns the new ids and the
    top-2 logit gap of every step."""
    cfg = GenerationConfig(max_new_tokens=n, do_sample=False, temperature=None, top_p=None, top_k=None,
                           repetition_penalty=penalty, eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    with torch.no_grad():
        res = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             generation_config=cfg, return_dict_in_generate=True, output_logits=True)
    gaps = [float(t[0] - t[1]) for t in (torch.topk(step[0].float(), 2).values for step in res.logits)]
    return res.sequences[0, len(ids):].tolist(), gaps


def reference(arch, out_dir):
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    gen = GenerationConfig.from_pretrained(out_dir)
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    half = copy.deepcopy(model).to(torch.bfloat16)  # only to report whether bf16 compute agrees
    result, stats = [], []
    for name, messages, tools, kwargs in cases(arch):
        ids = prompt_ids(tokenizer, messages, tools, kwargs)
        with torch.no_grad():
            last = model(torch.tensor([ids])).logits[0, -1].float()
        penalty = gen.repetition_penalty or 1.0
        out, gaps = greedy(model, ids, eos, pad, penalty=penalty)
        again, _ = greedy(model, ids, eos, pad, penalty=penalty)
        assert out == again, f"{arch}/{name}: generate is not deterministic"
        finish = "stop" if out and out[-1] in eos else "length"
        result.append({"name": name, "messages": messages, "tools": tools, "chat_template_kwargs": kwargs,
                       "prompt_ids": ids, "output_ids": out, "finish_reason": finish,
                       "text": tokenizer.decode(out, skip_special_tokens=True), "last_logits": last.tolist(),
                       "top2_gaps": gaps})
        bf16 = greedy(half, ids, eos, pad, penalty=penalty)[0]
        agree = next((f"diverges at {i}" for i, (x, y) in enumerate(zip(out, bf16)) if x != y),
                     "same" if out == bf16 else "length differs")
        stats.append((name, len(ids), len(out), finish, min(gaps), agree))
    return result, stats


def make(arch, out_dir, seed):
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = build_tokenizer(arch, seed)
    tokenizer.save_pretrained(out_dir)
    model = build_model(arch, tokenizer, seed)
    swapped = swap_end_of_turn(arch, model, tokenizer)
    model.to(torch.bfloat16).save_pretrained(out_dir)  # also writes generation_config.json
    cases_out, stats = reference(arch, out_dir)
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump({"arch": arch, "cases": cases_out}, f, indent=1)
    reloaded = AutoTokenizer.from_pretrained(out_dir)
    added = reloaded.backend_tokenizer.get_added_tokens_decoder()
    with open(os.path.join(out_dir, "special.json"), "w") as f:  # transformers 5's all_special_ids: bos/eos/pad/unk
        json.dump({"all_special_ids": sorted(reloaded.all_special_ids),
                   "added_special": {t.content: i for i, t in sorted(added.items()) if t.special},
                   "added_not_special": {t.content: i for i, t in sorted(added.items()) if not t.special}}, f, indent=1)
    return len(tokenizer), swapped, stats


def main():
    torch.set_num_threads(2)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("arch", nargs="?", choices=sorted(FAMILIES))
    p.add_argument("dir", nargs="?")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--selfcheck", nargs="?", const="/tmp/ckpt", metavar="ROOT")
    a = p.parse_args()
    if a.selfcheck is None and not (a.arch and a.dir):
        p.error("ARCH and DIR, or --selfcheck")
    for arch in ([a.arch] if a.selfcheck is None else ["llama", "qwen2", "qwen3", "mistral"]):
        vocab, (eot, swapped), stats = make(arch, a.dir or os.path.join(a.selfcheck, arch), a.seed)
        print(f"{arch}: vocab {vocab}, lm_head row of {eot} swapped with {swapped}")
        print(f"  {'case':<15} {'prompt':>6} {'output':>6}  finish  min top-2 gap  bf16 compute")
        for name, n_in, n_out, finish, gap, agree in stats:
            print(f"  {name:<15} {n_in:>6} {n_out:>6}  {finish:<6}  {gap:<12.4g}  {agree}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
