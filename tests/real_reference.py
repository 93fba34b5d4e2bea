"""Hugging Face reference for the real-weight tests, run in its own process (``python real_reference.py SPEC OUT``).

transformers loads the target GGUF file itself (de-quantised to float32 by its GGUF loader) and writes to ``OUT``:

- ``reference.json``: per sequence the prompt ids (HF's tokenizer and chat template), the greedy continuation
  (``generate(do_sample=False)`` stopping on the given ids) with each step's top-2 logits; an 8-node token tree
  built from the first sequence's greedy path and runner-up tokens; the end-of-generation probe; HF's own
  float32 self-disagreement (the same logits computed in one pass and through its KV cache);
- ``logits.safetensors``: ``prefill`` ``[T, V]`` of the first sequence's prompt and ``tree`` ``[8, V]`` (the
  last-position logits of HF run on prompt + the root-to-node path of each node).

It runs in a child process so that its ~9 GB (the float32 model and transformers' loading copies) are returned
to the system before the engine loads the same weights.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

import torch


def main(spec_path: str, out_dir: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(out_dir)
    torch.set_num_threads(int(spec.get("threads", 2)))
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    gguf = Path(spec["gguf"])
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    eos = list(spec["eos"])

    def prompt_ids(text: str, chat: bool) -> list[int]:
        if chat:
            enc = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)
            return [int(i) for i in enc["input_ids"]]
        return [int(i) for i in tok(text)["input_ids"]]

    def greedy(ids: list[int], new_tokens: int, stop) -> dict:
        x = torch.tensor([ids])
        with torch.no_grad():
            res = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False,
                                 eos_token_id=stop, pad_token_id=spec["pad"], output_logits=True,
                                 return_dict_in_generate=True)
        tokens = res.sequences[0, len(ids):].tolist()
        top = [lg[0].float().topk(2) for lg in res.logits]
        return {"tokens": tokens, "top2_ids": [t.indices.tolist() for t in top],
                "top2_logits": [t.values.tolist() for t in top]}

    sequences = []
    t1 = time.perf_counter()
    for seq in spec["sequences"]:
        ids = prompt_ids(seq["text"], seq["chat"])
        sequences.append({**seq, "prompt_ids": ids, **greedy(ids, spec["new_tokens"], eos)})
    generate_s = time.perf_counter() - t1

    # prefill logits of the first prompt, and HF's own float32 noise: the same rows through its KV cache
    first = sequences[0]
    prompt = torch.tensor([first["prompt_ids"]])
    T = prompt.shape[1]
    split = T - 8
    with torch.no_grad():
        prefill = model(prompt).logits[0].float()
        head = model(prompt[:, :split], use_cache=True)
        tail = model(prompt[:, split:], past_key_values=head.past_key_values, use_cache=True).logits[0].float()
    self_diff_prefill = float((prefill[split:] - tail).abs().max())

    # an 8-node tree from the greedy path g and runner-ups r (top-2 of each step); not in depth-first order
    g = first["tokens"]
    r = [pair[1] for pair in first["top2_ids"]]
    tree_tokens = [g[0], g[1], r[1], g[2], r[0], g[3], r[2], g[1]]
    tree_parents = [-1, 0, 0, 1, -1, 3, 1, 4]

    def path(i: int) -> list[int]:
        out_path = []
        while i != -1:
            out_path.append(tree_tokens[i])
            i = tree_parents[i]
        return out_path[::-1]

    rows, self_diff_tree = [], 0.0
    with torch.no_grad():
        cached = model(prompt, use_cache=True)
        for i in range(len(tree_tokens)):
            p = path(i)
            full = model(torch.tensor([first["prompt_ids"] + p])).logits[0, -1].float()
            kv = copy.deepcopy(cached.past_key_values)
            inc = model(torch.tensor([p]), past_key_values=kv, use_cache=True).logits[0, -1].float()
            rows.append(full)
            self_diff_tree = max(self_diff_tree, float((full - inc).abs().max()))
    tree_logits = torch.stack(rows)

    # end of generation: a closed assistant turn; HF with the GGUF's own generation config vs both stop ids
    probe_ids = prompt_ids(spec["eos_probe"]["text"], True) + tok(spec["eos_probe"]["suffix"])["input_ids"]
    probe_default = greedy(probe_ids, 4, None)  # model.generation_config's eos_token_id
    probe_both = greedy(probe_ids, 4, eos)
    # a short answer that ends with <|im_end|>
    answer_ids = prompt_ids(spec["eos_probe"]["text"], True)
    answer = greedy(answer_ids, 12, eos)

    result = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_s": round(load_s, 2),
        "generate_s": round(generate_s, 2),
        "hf_generation_config_eos": model.generation_config.eos_token_id,
        "hf_config_eos": model.config.eos_token_id,
        "sequences": sequences,
        "tree": {"tokens": tree_tokens, "parents": tree_parents},
        "self_diff": {"prefill": self_diff_prefill, "tree": self_diff_tree},
        "eos_probe": {"prompt_ids": probe_ids, "default": probe_default["tokens"], "both": probe_both["tokens"],
                      "top2_ids": probe_both["top2_ids"][0], "top2_logits": probe_both["top2_logits"][0],
                      "answer_prompt_ids": answer_ids, "answer": answer["tokens"]},
        "prefill_len": T,
    }
    save_file({"prefill": prefill.contiguous(), "tree": tree_logits.contiguous()}, str(out / "logits.safetensors"))
    (out / "reference.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
