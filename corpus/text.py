"""transformers entries: encoders, decoders, vision and audio models built from small configs.

The library's real module code (``Model(Config(...))``, random weights) at a tiny width, each
wrapped so forward() takes plain tensors and returns the tensors a user would serve. Text
models take ``input_ids`` and ``attention_mask`` of ``[batch, seq]`` with both dims dynamic.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from corpus import _compat
from corpus._torch import SEED, export_torch, image_entry
from corpus.harness import BATCHES, Entry, Made

HF = ("transformers",)
VOCAB = 128
SEQ = (8, 16, 32)  # min, opt (batches 1 and 3 run here), max (the profile's max batch runs here)


def _small(**extra: Any) -> dict[str, Any]:
    return dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=64, max_position_embeddings=64, **extra)  # fmt: skip


def _wrap(model: Any, pick: str = "last_hidden_state") -> Any:
    import torch

    class Served(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask)
            return getattr(out, pick)

    return Served()


def _text_inputs(batch: int, at_max: bool) -> dict[str, np.ndarray]:
    seq = SEQ[2] if at_max else SEQ[1]
    rng = np.random.default_rng(batch)
    ids = rng.integers(1, VOCAB, (batch, seq)).astype(np.int64)
    mask = np.ones((batch, seq), np.int64)
    if batch > 1:
        mask[1:, seq - 3 :] = 0  # padded rows, as a batch of sentences of different lengths
    return {"input_ids": ids, "attention_mask": mask}


def _text_entry(name: str, build: Callable[[], Any], about: str) -> Entry:
    def make(folder: Path) -> Made:
        import torch

        torch.manual_seed(SEED)
        shapes = {
            n: [(1, SEQ[0]), (BATCHES[1], SEQ[1]), (BATCHES[-1], SEQ[2])]
            for n in ("input_ids", "attention_mask")
        }
        seq = {"input_ids": {1: "seq"}, "attention_mask": {1: "seq"}}
        return export_torch(build(), folder, _text_inputs, shapes, seq)

    return Entry(name, "transformers", make, HF, about)


def _bert() -> Any:
    t = _compat.transformers()

    return _wrap(t.BertModel(t.BertConfig(**_small()), add_pooling_layer=False))


def _distilbert() -> Any:
    t = _compat.transformers()

    cfg = t.DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                             max_position_embeddings=64)  # fmt: skip
    return _wrap(t.DistilBertModel(cfg))


def _roberta() -> Any:
    t = _compat.transformers()

    return _wrap(t.RobertaModel(t.RobertaConfig(**_small(pad_token_id=0)), add_pooling_layer=False))


def _gpt2() -> Any:
    t = _compat.transformers()

    cfg = t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                       use_cache=False)  # fmt: skip
    return _wrap(t.GPT2LMHeadModel(cfg), "logits")


def _t5_encoder() -> Any:
    t = _compat.transformers()

    cfg = t.T5Config(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2)
    return _wrap(t.T5EncoderModel(cfg))


def _bart_encoder() -> Any:
    t = _compat.transformers()

    cfg = t.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                       encoder_attention_heads=2, decoder_attention_heads=2,
                       encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)  # fmt: skip
    return _wrap(t.BartModel(cfg).get_encoder())


class _Vision:
    """A transformers vision model serving one output from ``pixel_values``."""

    def __init__(self, make: Callable[[], Any], pick: str) -> None:
        self.make, self.pick = make, pick

    def __call__(self) -> Any:
        import torch

        model, pick = self.make(), self.pick

        class Served(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def forward(self, x: Any) -> Any:
                return getattr(self.model(pixel_values=x), pick)

        return Served()


def _vit() -> Any:
    t = _compat.transformers()

    return t.ViTModel(
        t.ViTConfig(image_size=64, patch_size=16, **_small()), add_pooling_layer=False
    )


def _convnext() -> Any:
    t = _compat.transformers()

    return t.ConvNextModel(t.ConvNextConfig(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1]))


def _resnet() -> Any:
    t = _compat.transformers()

    return t.ResNetModel(t.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128],
                                        depths=[1, 1, 1, 1]))  # fmt: skip


AUDIO = 1600  # samples of raw audio (0.1 s at 16 kHz)


def _wav2vec2_make(folder: Path) -> Made:
    import torch

    t = _compat.transformers()

    torch.manual_seed(SEED)
    cfg = t.Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, conv_dim=(16, 16, 16), conv_stride=(5, 4, 4),
                           conv_kernel=(10, 4, 4), num_conv_pos_embeddings=16,
                           num_conv_pos_embedding_groups=2, do_stable_layer_norm=True,
                           feat_extract_norm="layer")  # fmt: skip
    model = t.Wav2Vec2Model(cfg)

    class Served(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_values: Any) -> Any:
            return self.model(input_values=input_values).last_hidden_state

    def inputs(batch: int, at_max: bool) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(batch)
        return {"input_values": rng.standard_normal((batch, AUDIO)).astype(np.float32)}

    shapes = {"input_values": [(1, AUDIO), (BATCHES[1], AUDIO), (BATCHES[-1], AUDIO)]}
    return export_torch(Served(), folder, inputs, shapes)


FRAMES = 64  # log-mel frames (Whisper's encoder takes 2 x max_source_positions)


def _whisper_make(folder: Path) -> Made:
    import torch

    t = _compat.transformers()

    torch.manual_seed(SEED)
    cfg = t.WhisperConfig(vocab_size=VOCAB, num_mel_bins=16, d_model=32, encoder_layers=2,
                          decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                          encoder_ffn_dim=64, decoder_ffn_dim=64,
                          max_source_positions=FRAMES // 2, max_target_positions=32,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2,
                          decoder_start_token_id=1)  # fmt: skip
    encoder = t.WhisperModel(cfg).get_encoder()

    class Served(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(self, input_features: Any) -> Any:
            return self.encoder(input_features=input_features).last_hidden_state

    def inputs(batch: int, at_max: bool) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(batch)
        return {"input_features": rng.standard_normal((batch, 16, FRAMES)).astype(np.float32)}

    shape = (16, FRAMES)
    shapes = {"input_features": [(1, *shape), (BATCHES[1], *shape), (BATCHES[-1], *shape)]}
    return export_torch(Served(), folder, inputs, shapes)


ENTRIES: tuple[Entry, ...] = (
    _text_entry("hf-bert", _bert, "BertModel, 2 layers x 32 wide, seq 8..32"),
    _text_entry("hf-distilbert", _distilbert, "DistilBertModel, 2 layers x 32 wide, seq 8..32"),
    _text_entry("hf-roberta", _roberta, "RobertaModel, 2 layers x 32 wide, seq 8..32"),
    _text_entry("hf-gpt2", _gpt2, "GPT2LMHeadModel (logits), 2 layers x 32 wide, seq 8..32"),
    _text_entry("hf-t5-encoder", _t5_encoder, "T5EncoderModel, 2 layers x 32 wide, seq 8..32"),
    _text_entry("hf-bart-encoder", _bart_encoder, "BART encoder, 2 layers x 32 wide, seq 8..32"),
    image_entry("hf-vit", "transformers", _Vision(_vit, "last_hidden_state"), packages=HF,
                about="ViTModel, 2 layers x 32 wide, 64x64"),
    image_entry("hf-convnext", "transformers", _Vision(_convnext, "pooler_output"),
                packages=HF, about="ConvNextModel, depths 1-1-2-1, 64x64"),
    image_entry("hf-resnet", "transformers", _Vision(_resnet, "pooler_output"), packages=HF,
                about="ResNetModel, depths 1-1-1-1, 64x64"),
    Entry("hf-wav2vec2", "transformers", _wav2vec2_make, HF,
          f"Wav2Vec2Model, 2 layers x 32 wide, {AUDIO} audio samples"),
    Entry("hf-whisper-encoder", "transformers", _whisper_make, HF,
          f"Whisper encoder, 2 layers x 32 wide, 16 mel bins x {FRAMES} frames"),
)  # fmt: skip
