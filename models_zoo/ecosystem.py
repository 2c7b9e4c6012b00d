"""Small models from the PyTorch ecosystem libraries, each with example inputs, for fxopt's
ecosystem tests and ``benchmarks/coverage_ecosystem.py``.

The libraries are Hugging Face ``transformers`` and ``diffusers``, ``segmentation-models-pytorch``
(``smp``), ``monai`` and ``timm``. Each model is built from a config (or constructor arguments)
with random weights: nothing is downloaded, no hub is consulted, and no pretrained weights are
used. The models are deliberately tiny (hidden sizes 32-64, two layers, sequences of 16-32
tokens, images of 32-64 pixels) so one optimizes and verifies in seconds on a CPU.

The libraries are optional (the ``test`` extra: ``pip install -e .[test] -c constraints.txt``):
``models()`` imports each one only when asked for its models, and leaves out the models of a
library that is not installed, and the models that need a further package that is not (MONAI's
SwinUNETR and UNETR import ``einops``); ``skipped()`` says what was left out and why.

Deterministic like the rest of ``models_zoo``: ``build()`` runs under ``torch.random.fork_rng``
with only the CPU generator re-seeded (identical weights on every call, the global RNG left as it
was) and returns the model in train mode; ``inputs(batch_size)`` draws from a private
``torch.Generator`` and returns ``(args, kwargs)``, the positional and keyword arguments of
``forward`` as users pass them (Hugging Face models take keywords only: ``input_ids=``,
``attention_mask=``, ``labels=``; call ``fxopt.optimize(model, args, example_kwargs=kwargs)``).
"""

from __future__ import annotations

import difflib
import importlib.util
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fxopt.core.errors import InputError
from fxopt.models_zoo.entry import BUILD_SEED, INPUT_SEED, checked_batch

LIBRARIES = ("transformers", "diffusers", "smp", "monai", "timm")
_IMPORT_NAMES = {"transformers": "transformers", "diffusers": "diffusers",
                 "smp": "segmentation_models_pytorch", "monai": "monai", "timm": "timm"}

Inputs = tuple[tuple, dict[str, Any]]


@dataclass(frozen=True)
class EcosystemModel:
    """A named ecosystem model: how to build it and how to call it."""

    name: str                                   # e.g. "hf_gpt2_lm"
    library: str                                # one of LIBRARIES
    kind: str                                   # a short description
    build: Callable[[], nn.Module]              # deterministic; the model in train mode
    inputs: Callable[[int], Inputs]             # batch_size -> (args, kwargs), deterministic
    default_batch: int = 2


def _seeded(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # libraries' deprecation and init notices
            torch.random.default_generator.manual_seed(BUILD_SEED)
            model = factory()
        return model.train()

    return build


def _inputs(make: Callable[[int, torch.Generator], Inputs]) -> Callable[[int], Inputs]:
    def inputs(batch_size: int) -> Inputs:
        gen = torch.Generator().manual_seed(INPUT_SEED)
        return make(checked_batch(batch_size), gen)

    return inputs


def _image(batch: int, gen: torch.Generator, channels: int = 3, size: int = 64,
           *, dims: int = 2) -> torch.Tensor:
    return torch.randn((batch, channels, *(size,) * dims), generator=gen)


# ---------------------------------------------------------------- transformers

VOCAB = 1000
SEQ = 16
TARGET_SEQ = 8
HIDDEN = 32
HEADS = 4
LAYERS = 2
FFN = 64


def _ids(batch: int, gen: torch.Generator, seq: int = SEQ, low: int = 4) -> torch.Tensor:
    """Token ids in ``[low, VOCAB)``: the special ids (0-3 in every config here) are left out."""
    return torch.randint(low, VOCAB, (batch, seq), generator=gen)


def _lm_inputs(*, labels: bool, mask: bool = True) -> Callable[[int], Inputs]:
    def make(batch: int, gen: torch.Generator) -> Inputs:
        ids = _ids(batch, gen)
        kwargs: dict[str, Any] = {"input_ids": ids}
        if mask:
            kwargs["attention_mask"] = torch.ones_like(ids)
        if labels:
            kwargs["labels"] = ids.clone()
        return (), kwargs

    return _inputs(make)


def _padded_mask(batch: int) -> torch.Tensor:
    """An attention mask whose odd rows end in 4 padding positions (as a padded batch has)."""
    mask = torch.ones(batch, SEQ, dtype=torch.long)
    mask[1::2, -4:] = 0
    return mask


def _classifier_inputs(batch: int, gen: torch.Generator) -> Inputs:
    ids = _ids(batch, gen)
    labels = torch.randint(0, 2, (batch,), generator=gen)
    return (), {"input_ids": ids, "attention_mask": _padded_mask(batch), "labels": labels}


def _encoder_inputs(batch: int, gen: torch.Generator) -> Inputs:
    return (), {"input_ids": _ids(batch, gen), "attention_mask": _padded_mask(batch)}


def _mlm_inputs(batch: int, gen: torch.Generator) -> Inputs:
    ids = _ids(batch, gen)
    chosen = torch.rand(ids.shape, generator=gen) < 0.15
    chosen[:, 0] = True  # at least one predicted position per row
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    masked = torch.where(chosen, torch.full_like(ids, 3), ids)  # 3 is <mask>
    return (), {"input_ids": masked, "attention_mask": torch.ones_like(ids), "labels": labels}


def _seq2seq_inputs(batch: int, gen: torch.Generator) -> Inputs:
    ids = _ids(batch, gen)
    labels = _ids(batch, gen, TARGET_SEQ)
    return (), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _pixel_inputs(*, labels: bool, size: int = 32) -> Callable[[int], Inputs]:
    def make(batch: int, gen: torch.Generator) -> Inputs:
        kwargs: dict[str, Any] = {"pixel_values": _image(batch, gen, 3, size)}
        if labels:
            kwargs["labels"] = torch.randint(0, 10, (batch,), generator=gen)
        return (), kwargs

    return _inputs(make)


WHISPER_MELS = 16
WHISPER_FRAMES = 32  # twice max_source_positions: the encoder's second conv has stride 2


def _whisper_inputs(batch: int, gen: torch.Generator) -> Inputs:
    features = torch.randn(batch, WHISPER_MELS, WHISPER_FRAMES, generator=gen)
    return (), {"input_features": features, "labels": _ids(batch, gen, TARGET_SEQ)}


AUDIO_SAMPLES = 800


def _ctc_inputs(batch: int, gen: torch.Generator) -> Inputs:
    audio = torch.randn(batch, AUDIO_SAMPLES, generator=gen)
    labels = torch.randint(4, 32, (batch, 4), generator=gen)  # CTC targets: ids of the 32 chars
    return (), {"input_values": audio, "labels": labels}


_LM = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
           num_attention_heads=HEADS, intermediate_size=FFN, max_position_embeddings=64,
           bos_token_id=1, eos_token_id=2, pad_token_id=0)
_BERT = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
             num_attention_heads=HEADS, intermediate_size=FFN, max_position_embeddings=64,
             pad_token_id=0)


def _transformers() -> list[EcosystemModel]:
    import transformers as tf

    def gpt2(use_cache: bool) -> nn.Module:
        return tf.GPT2LMHeadModel(tf.GPT2Config(
            vocab_size=VOCAB, n_positions=64, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
            n_inner=FFN, bos_token_id=1, eos_token_id=2, pad_token_id=0, use_cache=use_cache))

    def llama() -> nn.Module:
        return tf.LlamaForCausalLM(tf.LlamaConfig(**_LM, num_key_value_heads=2,
                                                  use_cache=False))

    def mistral() -> nn.Module:
        return tf.MistralForCausalLM(tf.MistralConfig(**_LM, num_key_value_heads=2,
                                                      sliding_window=8, use_cache=False))

    def qwen2() -> nn.Module:
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**_LM, num_key_value_heads=2,
                                                  use_cache=False))

    def opt() -> nn.Module:
        return tf.OPTForCausalLM(tf.OPTConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, ffn_dim=FFN,
            num_attention_heads=HEADS, max_position_embeddings=64, word_embed_proj_dim=HIDDEN,
            bos_token_id=1, eos_token_id=2, pad_token_id=0, use_cache=False))

    def gpt_neox() -> nn.Module:
        return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**_LM, use_cache=False))

    def bert_classifier() -> nn.Module:
        return tf.BertForSequenceClassification(tf.BertConfig(**_BERT, num_labels=2))

    def bert() -> nn.Module:
        return tf.BertModel(tf.BertConfig(**_BERT))

    def distilbert() -> nn.Module:
        return tf.DistilBertForSequenceClassification(tf.DistilBertConfig(
            vocab_size=VOCAB, dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS, hidden_dim=FFN,
            max_position_embeddings=64, pad_token_id=0, num_labels=2))

    def roberta() -> nn.Module:
        return tf.RobertaForMaskedLM(tf.RobertaConfig(
            **{**_BERT, "pad_token_id": 1}, bos_token_id=0, eos_token_id=2))

    def t5() -> nn.Module:
        return tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN,
            num_layers=LAYERS, num_decoder_layers=LAYERS, num_heads=HEADS,
            relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0,
            eos_token_id=1, use_cache=False))

    def bart() -> nn.Module:
        return tf.BartForConditionalGeneration(tf.BartConfig(
            vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS,
            encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
            encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, max_position_embeddings=64,
            bos_token_id=0, pad_token_id=1, eos_token_id=2, decoder_start_token_id=2,
            forced_eos_token_id=2, use_cache=False))

    def vit() -> nn.Module:
        return tf.ViTForImageClassification(tf.ViTConfig(
            image_size=32, patch_size=8, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, intermediate_size=FFN, num_labels=10))

    def clip_vision() -> nn.Module:
        return tf.CLIPVisionModel(tf.CLIPVisionConfig(
            image_size=32, patch_size=8, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, intermediate_size=FFN, projection_dim=HIDDEN))

    def whisper() -> nn.Module:
        return tf.WhisperForConditionalGeneration(tf.WhisperConfig(
            vocab_size=VOCAB, num_mel_bins=WHISPER_MELS, d_model=HIDDEN,
            encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=HEADS,
            decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN,
            max_source_positions=WHISPER_FRAMES // 2, max_target_positions=32,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
            begin_suppress_tokens=None, suppress_tokens=None, use_cache=False))

    def wav2vec2() -> nn.Module:
        return tf.Wav2Vec2ForCTC(tf.Wav2Vec2Config(
            vocab_size=32, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, intermediate_size=FFN,
            conv_dim=(32, 32, 32), conv_stride=(5, 4, 2), conv_kernel=(10, 4, 2),
            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
            mask_time_prob=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2))

    spec: list[tuple[str, str, Callable[[], nn.Module], Callable[[int], Inputs]]] = [
        ("hf_gpt2_lm", "decoder-only LM (GPT-2), labels",
         lambda: gpt2(False), _lm_inputs(labels=True)),
        ("hf_gpt2_lm_use_cache", "GPT-2 LM with use_cache left on (expect a TraceError)",
         lambda: gpt2(True), _lm_inputs(labels=True)),
        ("hf_llama_lm", "decoder-only LM (Llama: RoPE, GQA, RMSNorm), labels",
         llama, _lm_inputs(labels=True)),
        ("hf_mistral_lm", "decoder-only LM (Mistral: sliding window), no labels",
         mistral, _lm_inputs(labels=False)),
        ("hf_qwen2_lm", "decoder-only LM (Qwen2), labels", qwen2, _lm_inputs(labels=True)),
        ("hf_opt_lm", "decoder-only LM (OPT), labels", opt, _lm_inputs(labels=True)),
        ("hf_gpt_neox_lm", "decoder-only LM (GPT-NeoX: parallel residual), labels",
         gpt_neox, _lm_inputs(labels=True)),
        ("hf_bert_classifier", "encoder classifier (BERT), padded mask, labels",
         bert_classifier, _inputs(_classifier_inputs)),
        ("hf_bert", "encoder (BertModel), padded mask, no labels",
         bert, _inputs(_encoder_inputs)),
        ("hf_distilbert_classifier", "encoder classifier (DistilBERT), padded mask, labels",
         distilbert, _inputs(_classifier_inputs)),
        ("hf_roberta_mlm", "masked LM (RoBERTa), labels", roberta, _inputs(_mlm_inputs)),
        ("hf_t5_seq2seq", "encoder-decoder (T5: relative position bias), labels",
         t5, _inputs(_seq2seq_inputs)),
        ("hf_bart_seq2seq", "encoder-decoder (BART), labels", bart, _inputs(_seq2seq_inputs)),
        ("hf_vit_classifier", "vision transformer classifier (ViT), 32 px, labels",
         vit, _pixel_inputs(labels=True)),
        ("hf_clip_vision", "vision tower (CLIPVisionModel), 32 px", clip_vision,
         _pixel_inputs(labels=False)),
        ("hf_whisper_seq2seq", "speech encoder-decoder (Whisper), log-mel input, labels",
         whisper, _inputs(_whisper_inputs)),
        ("hf_wav2vec2_ctc", "speech encoder (Wav2Vec2, conv feature extractor), CTC labels",
         wav2vec2, _inputs(_ctc_inputs)),
    ]
    return [EcosystemModel(name, "transformers", kind, _seeded(factory), inputs)
            for name, kind, factory, inputs in spec]


# ---------------------------------------------------------------- diffusers

def _unet2d_inputs(batch: int, gen: torch.Generator) -> Inputs:
    sample = _image(batch, gen, 3, 32)
    timestep = torch.randint(0, 1000, (batch,), generator=gen)
    return (sample, timestep), {}


def _unet2d_condition_inputs(batch: int, gen: torch.Generator) -> Inputs:
    sample = _image(batch, gen, 4, 16)
    timestep = torch.randint(0, 1000, (batch,), generator=gen)
    context = torch.randn(batch, 8, 32, generator=gen)
    return (sample, timestep), {"encoder_hidden_states": context}


def _vae_inputs(batch: int, gen: torch.Generator) -> Inputs:
    return (_image(batch, gen, 3, 32),), {}


def _diffusers() -> list[EcosystemModel]:
    import diffusers as df

    def unet2d() -> nn.Module:
        return df.UNet2DModel(
            sample_size=32, in_channels=3, out_channels=3, layers_per_block=1,
            block_out_channels=(32, 64), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8,
            attention_head_dim=8)

    def unet2d_condition() -> nn.Module:
        return df.UNet2DConditionModel(
            sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
            block_out_channels=(32, 64),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8)

    def vae() -> nn.Module:
        return df.AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 64),
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, norm_num_groups=8,
            sample_size=32)

    return [
        EcosystemModel("diffusers_unet2d", "diffusers",
                       "denoising UNet with self attention, tensor timesteps, 32 px",
                       _seeded(unet2d), _inputs(_unet2d_inputs)),
        EcosystemModel("diffusers_unet2d_condition", "diffusers",
                       "text-conditioned UNet (cross attention), 16 px latents",
                       _seeded(unet2d_condition), _inputs(_unet2d_condition_inputs)),
        EcosystemModel("diffusers_autoencoder_kl", "diffusers",
                       "VAE (AutoencoderKL), posterior mode, 32 px",
                       _seeded(vae), _inputs(_vae_inputs)),
    ]


# ---------------------------------------------------------------- segmentation-models-pytorch

SMP_ARCHITECTURES = ("Unet", "FPN", "DeepLabV3Plus", "Linknet", "PSPNet")


def _smp() -> list[EcosystemModel]:
    import segmentation_models_pytorch as smp

    def factory(arch: str) -> Callable[[], nn.Module]:
        return lambda: getattr(smp, arch)(encoder_name="resnet18", encoder_weights=None,
                                          in_channels=3, classes=2)

    image = _inputs(lambda batch, gen: ((_image(batch, gen, 3, 64),), {}))
    return [EcosystemModel(f"smp_{arch.lower()}", "smp",
                           f"{arch} segmentation, resnet18 encoder, 64 px",
                           _seeded(factory(arch)), image)
            for arch in SMP_ARCHITECTURES]


# ---------------------------------------------------------------- monai

def _monai() -> list[EcosystemModel]:
    from monai.networks import nets

    def unet() -> nn.Module:
        return nets.UNet(spatial_dims=2, in_channels=1, out_channels=2, channels=(8, 16, 32),
                         strides=(2, 2), num_res_units=2)

    def dynunet() -> nn.Module:
        return nets.DynUNet(spatial_dims=2, in_channels=1, out_channels=2,
                            kernel_size=(3, 3, 3), strides=(1, 2, 2),
                            upsample_kernel_size=(2, 2), filters=(16, 32, 64))

    def swin_unetr() -> nn.Module:
        return nets.SwinUNETR(in_channels=1, out_channels=2, feature_size=12,
                              depths=(1, 1, 1, 1), num_heads=(3, 3, 3, 3), spatial_dims=2)

    def unetr() -> nn.Module:
        return nets.UNETR(in_channels=1, out_channels=2, img_size=(64, 64), feature_size=8,
                          hidden_size=48, mlp_dim=96, num_heads=4, spatial_dims=2)

    image = _inputs(lambda batch, gen: ((_image(batch, gen, 1, 64),), {}))
    spec = [("monai_unet", "residual UNet, 2D, 64 px", unet),
            ("monai_dynunet", "DynUNet (nnU-Net style), 2D, 64 px", dynunet),
            ("monai_swin_unetr", "SwinUNETR (shifted windows), 2D, 64 px", swin_unetr),
            ("monai_unetr", "UNETR (ViT encoder, 12 layers of width 48), 2D, 64 px", unetr)]
    return [EcosystemModel(name, "monai", kind, _seeded(factory), image)
            for name, kind, factory in spec]


# ---------------------------------------------------------------- timm

# 40 timm model names, fixed here, chosen once by walking
# ``random.Random(0).shuffle(sorted(timm.list_models()))`` (timm 1.0.31) and keeping the first
# that build with ``timm.create_model(name, pretrained=False, num_classes=10)``, have at most 30M
# parameters, a default input of at most 224 px, and run a train-mode forward and backward at
# 2 x 3 x 64 x 64. The names in TIMM_IMG_SIZE take ``img_size=64`` (their position embeddings or
# window grids are sized by it); the others are fully convolutional and need no size.
TIMM_MODELS = (
    "regnetz_b16_evos", "nf_seresnet26", "tiny_vit_11m_224", "mobileone_s2", "mvitv2_tiny",
    "densenet161", "efficientformerv2_s2", "resnetv2_50d", "coatnet_0_rw_224", "rexnetr_130",
    "mobilenetv1_100h", "coatnet_rmlp_nano_rw_224", "mobilenet_edgetpu_v2_m",
    "iformer_l_distilled", "ecaresnet50d_pruned", "xcit_nano_12_p16_224", "hardcorenas_e",
    "mobileone_s0", "resnetv2_18", "repvit_m1_5", "hardcorenas_c", "coatnet_bn_0_rw_224",
    "seresnext26t_32x4d", "convit_tiny", "shvit_s3", "mobilenetv2_050", "repghostnet_130",
    "ghostnetv3_160", "resnext50_32x4d", "vit_small_patch16_224", "coat_lite_mini", "tinynet_e",
    "convnext_nano_ols", "seresnet34", "efficientvim_m3_dist", "mobilenet_edgetpu_100",
    "convnextv2_atto", "resnetv2_50t", "regnetx_016", "skresnet50",
)
TIMM_IMG_SIZE = frozenset({
    "regnetz_b16_evos", "mobileone_s2", "mvitv2_tiny", "efficientformerv2_s2",
    "coatnet_0_rw_224", "coatnet_rmlp_nano_rw_224", "xcit_nano_12_p16_224", "mobileone_s0",
    "repvit_m1_5", "coatnet_bn_0_rw_224", "convit_tiny", "vit_small_patch16_224",
    "coat_lite_mini",
})
TIMM_SIZE = 64


def _timm() -> list[EcosystemModel]:
    import timm

    def factory(name: str) -> Callable[[], nn.Module]:
        size = {"img_size": TIMM_SIZE} if name in TIMM_IMG_SIZE else {}
        return lambda: timm.create_model(name, pretrained=False, num_classes=10, **size)

    image = _inputs(lambda batch, gen: ((_image(batch, gen, 3, TIMM_SIZE),), {}))
    return [EcosystemModel(f"timm_{name}", "timm", f"timm {name}, 10 classes, {TIMM_SIZE} px",
                           _seeded(factory(name)), image)
            for name in TIMM_MODELS]


# ---------------------------------------------------------------- lookup

_CATALOGUES: dict[str, Callable[[], list[EcosystemModel]]] = {
    "transformers": _transformers, "diffusers": _diffusers, "smp": _smp, "monai": _monai,
    "timm": _timm,
}


# Models that import a package beyond their library, which the library does not install itself.
REQUIRES = {"monai_swin_unetr": "einops", "monai_unetr": "einops"}


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def installed(library: str) -> bool:
    """Whether ``library`` (one of LIBRARIES) can be imported here."""
    return _importable(_IMPORT_NAMES[library])


def _checked_library(library: str) -> str:
    if library not in LIBRARIES:
        raise InputError(f"unknown ecosystem library {library!r}", where="models_zoo.ecosystem",
                         hint=f"use one of: {', '.join(LIBRARIES)}")
    return library


def models(library: str | None = None) -> list[EcosystemModel]:
    """The models of ``library`` (or of every library), leaving out libraries not installed."""
    libraries = LIBRARIES if library is None else (_checked_library(library),)
    return [model for lib in libraries if installed(lib) for model in _CATALOGUES[lib]()
            if _importable(REQUIRES.get(model.name, "torch"))]


def skipped(library: str | None = None) -> list[tuple[str, str]]:
    """``(library or model name, why)`` for what ``models(library)`` leaves out."""
    libraries = LIBRARIES if library is None else (_checked_library(library),)
    notes = [(lib, f"{_IMPORT_NAMES[lib]} is not installed") for lib in libraries
             if not installed(lib)]
    notes += [(name, f"needs {module}, which is not installed")
              for name, module in REQUIRES.items()
              if library_of(name) in libraries and installed(library_of(name))
              and not _importable(module)]
    return notes


def names(library: str | None = None) -> list[str]:
    """The names ``models(library)`` gives, in catalogue order."""
    return [model.name for model in models(library)]


def library_of(name: str) -> str | None:
    """The library a model name belongs to, from its prefix, without importing anything."""
    prefixes = {"hf": "transformers", "diffusers": "diffusers", "smp": "smp", "monai": "monai",
                "timm": "timm"}
    return prefixes.get(name.split("_", 1)[0])


def get(name: str) -> EcosystemModel:
    """The model called ``name``; an unknown name (or one of a library not installed) raises
    ``InputError``."""
    library = library_of(name)
    candidates = models(library) if library and installed(library) else []
    found = next((model for model in candidates if model.name == name), None)
    if found is not None:
        return found
    if library and not installed(library):
        raise InputError(f"ecosystem model {name!r} needs {library}, which is not installed",
                         where="models_zoo.ecosystem",
                         hint="install the test extra: pip install -e .[test] -c constraints.txt")
    if name in REQUIRES and not _importable(REQUIRES[name]):
        raise InputError(f"ecosystem model {name!r} needs {REQUIRES[name]}, which is not "
                         "installed", where="models_zoo.ecosystem",
                         hint=f"pip install {REQUIRES[name]}")
    known = names()
    close = difflib.get_close_matches(name, known, n=1)
    suggestion = f"; did you mean {close[0]!r}?" if close else ""
    raise InputError(f"unknown ecosystem model {name!r}{suggestion}",
                     where="models_zoo.ecosystem", hint=f"use one of: {', '.join(known)}")
