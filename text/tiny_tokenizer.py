"""A small real tokenizer for random-weight test checkpoints (`k3x init-checkpoint`), trained at init time.

A byte-level BPE (the `tokenizers` library) trained on the short text below, so any text encodes and
decodes exactly; its vocabulary (256 bytes + merges + specials) never exceeds the model's. Specials:
`<|bos|>`, `<|eos|>`, `<|user|>`, `<|assistant|>`; a ChatML-like chat template in tokenizer_config.json.
Training is deterministic: the same model vocabulary gives byte-identical files.
"""

from __future__ import annotations

import json

SPECIALS = ("<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>")
MAX_VOCAB = 512  # the k3-mini vocabulary
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
TEXT = """\
The model reads a prompt, one token at a time, and keeps a small state for every linear attention layer and a
latent cache for every global attention layer. A prefill call reads the whole prompt at once; then each decode
step reads one new token, updates the state, and writes the next one. The state is carried from call to call,
so the export can run in any runtime that passes tensors in and out: PyTorch, ONNX Runtime, or TensorRT.
Hello! How are you today? I am fine, thank you. What is the weather like? It is sunny and warm, with a light
wind from the sea. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2026. Questions and answers, tests and results,
parity and tolerance: the exported graph must give the same tokens as the eager model, step after step.
"""


def tokenizer_files(vocab_size: int) -> dict[str, bytes]:
    """{file name: bytes}: tokenizer.json, tokenizer_config.json and generation_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    size = min(vocab_size, MAX_VOCAB)
    if size < 256 + len(SPECIALS):
        raise ValueError(f"vocab_size={vocab_size}: a byte-level tokenizer needs at least {256 + len(SPECIALS)}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT.splitlines(keepends=True), trainer)
    bos, eos = tok.token_to_id(SPECIALS[0]), tok.token_to_id(SPECIALS[1])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0], "eos_token": SPECIALS[1],
              "model_max_length": 4096, "chat_template": CHAT_TEMPLATE}
    generation = {"bos_token_id": bos, "eos_token_id": eos}
    return {"tokenizer.json": tok.to_str().encode(),
            "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode(),
            "generation_config.json": (json.dumps(generation, indent=2) + "\n").encode()}
