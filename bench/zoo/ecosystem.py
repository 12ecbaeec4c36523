"""The ecosystem zoo: models from the PyTorch ecosystem beyond ``transformers`` (issue 15).

Each entry builds a small model with random weights (no downloads) from a library that installs
on a CPU-only machine next to torch 2.13 (``pip install -e '.[zoo]'``), with example inputs and
the dynamic shapes a user of that library would declare, and a note of what it exercises:

- ``torch.nn`` builtins rarely exported: masked Transformer/MHA, bidirectional and packed RNNs,
  an STFT log-mel front-end, a grid_sample STN, EmbeddingBag, pixel shuffle, a Fourier layer;
- ``transformers``' newer families: mixture-of-experts, state-space and audio-codec models;
- diffusers (UNets, VAE, DiT/SD3/Flux transformers), torch-geometric (message passing, pooling),
  kornia (colour, filters, warps), monai (3-D/2-D segmentation nets), e3nn (equivariant tensor
  products), gpytorch (GP prediction), zuko/nflows/pyro (flows and distributions), torchdiffeq
  and torchcde (ODE solvers), sentence-transformers (pooling), einops-based models,
  x-transformers, vector-quantize-pytorch, rotary-embedding-torch, normflows,
  neuraloperator, asteroid-filterbanks and julius (DSP).

    onnxmedic sweep bench/zoo/ecosystem.py:ALL --jobs 2 --results build/eco.json
    python bench/peers/zoo_bench.py --zoo bench/zoo/ecosystem.py:ALL --results build/eco_bench.json

``ZOO`` maps a name ("library/model") to a factory; ``ALL`` holds every entry twice (string dims,
and ``torch.export.Dim`` objects as ``NAME@Dim``), each written file also run at its declared
dims' sizes 1, the example's, 2x and a prime (``onnxmedic.sweep.sizes``). ``FAST`` is the subset
the default tests export. A library that is not installed makes its entries fail with a clear
ImportError in the worker, not the whole zoo.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from onnxmedic.sweep import ZooCase
from onnxmedic.sweep.sizes import with_size_check

B = 2


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=_g(seed))


def _eval(m: nn.Module) -> nn.Module:
    return m.eval()


# ---------------------------------------------------------------------------------------------
# torch.nn builtins
# ---------------------------------------------------------------------------------------------

class MaskedTransformer(nn.Module):
    """nn.Transformer with a source padding mask and a causal target mask made from its length."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Transformer(d_model=32, nhead=2, num_encoder_layers=2, num_decoder_layers=2,
                                dim_feedforward=64, dropout=0.0, batch_first=True)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_pad: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return self.t(src, tgt, tgt_mask=causal, src_key_padding_mask=src_pad,
                      memory_key_padding_mask=src_pad)


def nn_transformer() -> ZooCase:
    torch.manual_seed(0)
    pad = torch.zeros(B, 10, dtype=torch.bool)
    pad[1, 7:] = True
    return ZooCase(_eval(MaskedTransformer()), (_randn(B, 10, 32), _randn(B, 6, 32, seed=1), pad),
                   {}, ({0: "batch", 1: "src"}, {0: "batch", 1: "tgt"}, {0: "batch", 1: "src"}),
                   note="nn.Transformer, padding mask and a causal mask built from the length")


class MaskedMHA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
        return self.mha(x, x, x, key_padding_mask=pad, attn_mask=causal, need_weights=False)[0]


def nn_mha() -> ZooCase:
    torch.manual_seed(0)
    pad = torch.zeros(B, 9, dtype=torch.bool)
    pad[0, 6:] = True
    return ZooCase(_eval(MaskedMHA()), (_randn(B, 9, 32), pad), {},
                   ({0: "batch", 1: "seq"}, {0: "batch", 1: "seq"}),
                   note="nn.MultiheadAttention with key padding and boolean causal masks")


def nn_encoder_fastpath() -> ZooCase:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True, norm_first=True)
    m = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    return ZooCase(_eval(m), (_randn(B, 7, 32),), {}, ({0: "batch", 1: "seq"},),
                   note="TransformerEncoder in eval mode (PyTorch's fused fast path)")


class BiLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(16, 24, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(48, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


def nn_bilstm() -> ZooCase:
    torch.manual_seed(0)
    return ZooCase(_eval(BiLSTM()), (_randn(B, 11, 16),), {}, ({0: "batch", 1: "time"},),
                   note="two-layer bidirectional LSTM")


class PackedGRU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(8, 16, batch_first=True)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True,
                                                   enforce_sorted=False)
        out, h = self.rnn(packed)
        return h[0]


def nn_packed_gru() -> ZooCase:
    torch.manual_seed(0)
    return ZooCase(_eval(PackedGRU()), (_randn(B, 9, 8), torch.tensor([9, 5])), {},
                   ({0: "batch", 1: "time"}, {0: "batch"}),
                   note="GRU over a packed padded sequence (per-sample lengths)")


class PackedBiLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 12, num_layers=2, bidirectional=True)
        self.head = nn.Linear(24, 4)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, ...]:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
        out, (h, c) = self.rnn(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out)  # max(lengths) steps, zeros past each
        return self.head(out), h, c


def nn_packed_bilstm() -> ZooCase:
    torch.manual_seed(0)
    return ZooCase(_eval(PackedBiLSTM()), (_randn(9, 3, 8), torch.tensor([4, 9, 1])), {},
                   ({0: "time", 1: "batch"}, {0: "batch"}),
                   note="two-layer bidirectional LSTM over a packed sequence (time first, "
                        "unsorted lengths), padded back, with its final states")


class LogMel(nn.Module):
    """STFT log-mel front-end: hann window, power spectrum, a fixed mel matrix, log."""

    def __init__(self, n_fft: int = 64, mels: int = 16) -> None:
        super().__init__()
        self.n_fft = n_fft
        self.register_buffer("window", torch.hann_window(n_fft))
        fb = torch.rand(n_fft // 2 + 1, mels, generator=_g(3))
        self.register_buffer("mel", fb / fb.sum(0, keepdim=True))
        self.proj = nn.Conv1d(mels, 8, 3, padding=1)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        spec = torch.stft(wav, self.n_fft, hop_length=16, window=self.window, center=True,
                          return_complex=True)
        power = spec.abs().pow(2)
        mel = torch.matmul(power.transpose(1, 2), self.mel).transpose(1, 2)
        return self.proj(torch.log(mel + 1e-6))


def nn_stft_logmel() -> ZooCase:
    return ZooCase(_eval(LogMel()), (_randn(B, 800),), {}, ({0: "batch", 1: "samples"},),
                   note="torch.stft (complex) log-mel front-end")


class STN(nn.Module):
    """Spatial transformer: a localisation net predicts an affine grid, grid_sample warps."""

    def __init__(self) -> None:
        super().__init__()
        self.loc = nn.Sequential(nn.Conv2d(1, 8, 5, stride=2), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(128, 6))
        nn.init.zeros_(self.loc[-1].weight)
        with torch.no_grad():
            self.loc[-1].bias.copy_(torch.tensor([1.0, 0.1, 0.0, -0.1, 1.0, 0.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        theta = self.loc(x).view(-1, 2, 3)
        grid = nn.functional.affine_grid(theta, list(x.shape), align_corners=False)
        return nn.functional.grid_sample(x, grid, align_corners=False)


def nn_stn() -> ZooCase:
    torch.manual_seed(0)
    return ZooCase(_eval(STN()), (_randn(B, 1, 28, 28),), {},
                   ({0: "batch", 2: "height", 3: "width"},),
                   note="spatial transformer: affine_grid + bilinear grid_sample")


class BagModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(50, 16, mode="mean")
        self.fc = nn.Linear(16, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bag(tokens))


def nn_embedding_bag() -> ZooCase:
    torch.manual_seed(0)
    return ZooCase(_eval(BagModel()), (torch.randint(0, 50, (B, 7), generator=_g()),), {},
                   ({0: "batch", 1: "bag"},), note="EmbeddingBag (mean) over fixed-size bags")


class ESPCN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 5, padding=2), nn.Tanh(),
                                  nn.Conv2d(16, 3 * 9, 3, padding=1), nn.PixelShuffle(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def nn_pixel_shuffle() -> ZooCase:
    torch.manual_seed(0)
    return ZooCase(_eval(ESPCN()), (_randn(B, 3, 12, 16),), {},
                   ({0: "batch", 2: "height", 3: "width"},), note="sub-pixel conv super-resolution")


class SpectralConv2d(nn.Module):
    """A Fourier layer (FNO): rfft2, complex weights on the low modes, irfft2."""

    def __init__(self, ch: int = 8, modes: int = 4) -> None:
        super().__init__()
        self.modes = modes
        scale = 1 / (ch * ch)
        self.w = nn.Parameter(scale * torch.randn(ch, ch, modes, modes, 2, generator=_g(1)))
        self.skip = nn.Conv2d(ch, ch, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        xf = torch.fft.rfft2(x)
        m = self.modes
        wc = torch.view_as_complex(self.w)
        low = torch.einsum("bixy,ioxy->boxy", xf[:, :, :m, :m], wc)
        out = torch.zeros_like(xf)
        out[:, :, :m, :m] = low
        return nn.functional.gelu(torch.fft.irfft2(out, s=(h, w)) + self.skip(x))


def nn_fourier_layer() -> ZooCase:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(1, 8, 1), SpectralConv2d(), SpectralConv2d(), nn.Conv2d(8, 1, 1))
    return ZooCase(_eval(m), (_randn(B, 1, 16, 16),), {},
                   ({0: "batch", 2: "height", 3: "width"},),
                   note="Fourier neural operator layers written with torch.fft (complex einsum)")


# ---------------------------------------------------------------------------------------------
# transformers: newer families
# ---------------------------------------------------------------------------------------------

def _hf(model_type: str, cls: str = "AutoModel", **cfg: Any) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **cfg)
    return getattr(transformers, cls).from_config(config).eval()


class LastHidden(nn.Module):
    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=input_ids, use_cache=False).last_hidden_state


TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            vocab_size=128, max_position_embeddings=64, num_key_value_heads=1, head_dim=16)


def hf_text(model_type: str, note: str, **cfg: Any) -> Callable[[], ZooCase]:
    def make() -> ZooCase:
        m = _eval(LastHidden(_hf(model_type, **{**TINY, **cfg})))
        ids = torch.randint(4, 128, (B, 8), generator=_g())
        return ZooCase(m, (ids,), {}, ({0: "batch", 1: "seq"},), note=note)

    return make


def hf_mamba() -> ZooCase:
    m = _hf("mamba", hidden_size=32, num_hidden_layers=2, vocab_size=128, state_size=8,
            expand=2, conv_kernel=4)
    ids = torch.randint(4, 128, (B, 8), generator=_g())
    return ZooCase(_eval(LastHidden(m)), (ids,), {}, ({0: "batch", 1: "seq"},),
                   note="Mamba selective state-space model (slow path: a Python scan)")


class CodecRoundTrip(nn.Module):
    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, input_values: torch.Tensor) -> torch.Tensor:
        return self.m(input_values).audio_values


def hf_encodec() -> ZooCase:
    m = _hf("encodec", num_filters=4, hidden_size=16, codebook_size=32, codebook_dim=16,
            num_lstm_layers=1, upsampling_ratios=[4, 2], target_bandwidths=[1.5, 3.0],
            sampling_rate=800, audio_channels=1, normalize=False, use_causal_conv=True)
    return ZooCase(_eval(CodecRoundTrip(m)), (_randn(B, 1, 640),), {}, ({0: "batch", 2: "samples"},),
                   note="EnCodec audio codec: encode, residual VQ, decode (bandwidth check)")


def hf_dac() -> ZooCase:
    m = _hf("dac", encoder_hidden_size=8, downsampling_ratios=[2, 4], decoder_hidden_size=32,
            n_codebooks=2, codebook_size=32, codebook_dim=4, hidden_size=32,
            upsampling_ratios=[4, 2])
    return ZooCase(_eval(CodecRoundTrip(m)), (_randn(B, 1, 512),), {}, ({0: "batch", 2: "samples"},),
                   note="DAC audio codec: snake activations and residual VQ")


# ---------------------------------------------------------------------------------------------
# diffusers
# ---------------------------------------------------------------------------------------------

class Sample(nn.Module):
    """``.sample`` of a diffusers model (the tensor users deploy), the inputs named as the model
    names them: diffusers' forwards take many optional keywords."""

    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.m = m


class UNetSample(Sample):
    def forward(self, sample: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        return self.m(sample, timestep, return_dict=False)[0]


class CondUNetSample(Sample):
    def forward(self, sample: torch.Tensor, timestep: torch.Tensor,
                encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        return self.m(sample, timestep, encoder_hidden_states, return_dict=False)[0]


class DiTSample(Sample):
    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor,
                class_labels: torch.Tensor) -> torch.Tensor:
        return self.m(hidden_states, timestep=timestep, class_labels=class_labels,
                      return_dict=False)[0]


class SD3Sample(Sample):
    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                pooled_projections: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        return self.m(hidden_states, encoder_hidden_states=encoder_hidden_states,
                      pooled_projections=pooled_projections, timestep=timestep,
                      return_dict=False)[0]


class FluxSample(Sample):
    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                pooled_projections: torch.Tensor, timestep: torch.Tensor, img_ids: torch.Tensor,
                txt_ids: torch.Tensor) -> torch.Tensor:
        return self.m(hidden_states, encoder_hidden_states=encoder_hidden_states,
                      pooled_projections=pooled_projections, timestep=timestep, img_ids=img_ids,
                      txt_ids=txt_ids, return_dict=False)[0]


def df_unet2d() -> ZooCase:
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    m = UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                    block_out_channels=(16, 32), norm_num_groups=8,
                    down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                    up_block_types=("AttnUpBlock2D", "UpBlock2D"))
    t = torch.tensor([10, 500])
    return ZooCase(_eval(UNetSample(m)), (_randn(B, 3, 16, 16), t), {},
                   ({0: "batch", 2: "height", 3: "width"}, {0: "batch"}),
                   note="DDPM-style UNet with attention blocks and timestep embedding")


def df_unet2d_cond() -> ZooCase:
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    m = UNet2DConditionModel(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
                             block_out_channels=(16, 32), norm_num_groups=8,
                             cross_attention_dim=24, attention_head_dim=4,
                             down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                             up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    return ZooCase(_eval(CondUNetSample(m)),
                   (_randn(B, 4, 16, 16), torch.tensor([10, 500]), _randn(B, 7, 24, seed=1)),
                   {}, ({0: "batch", 2: "height", 3: "width"}, {0: "batch"},
                        {0: "batch", 1: "text"}),
                   note="Stable-Diffusion-style conditional UNet with cross-attention")


class VAERoundTrip(nn.Module):
    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.m.encode(x).latent_dist.mode()
        return self.m.decode(z).sample


def df_vae() -> ZooCase:
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    m = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4,
                      block_out_channels=(16, 32), norm_num_groups=8, layers_per_block=1,
                      down_block_types=("DownEncoderBlock2D",) * 2,
                      up_block_types=("UpDecoderBlock2D",) * 2)
    return ZooCase(_eval(VAERoundTrip(m)), (_randn(B, 3, 16, 16),), {},
                   ({0: "batch", 2: "height", 3: "width"},),
                   note="AutoencoderKL encode (mode) + decode, with mid-block attention")


def df_dit() -> ZooCase:
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(0)
    m = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                              num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=10)
    return ZooCase(_eval(DiTSample(m)),
                   (_randn(B, 4, 8, 8), torch.tensor([3, 7]), torch.tensor([1, 2])), {},
                   ({0: "batch"}, {0: "batch"}, {0: "batch"}),
                   note="DiT: patchified transformer with adaLN-zero conditioning")


def df_sd3() -> ZooCase:
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    m = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2,
                              attention_head_dim=8, num_attention_heads=2,
                              joint_attention_dim=24, caption_projection_dim=16,
                              pooled_projection_dim=12, out_channels=4, pos_embed_max_size=16)
    return ZooCase(_eval(SD3Sample(m)),
                   (_randn(B, 4, 8, 8), _randn(B, 5, 24, seed=1), _randn(B, 12, seed=2),
                    torch.tensor([3.0, 7.0])), {},
                   ({0: "batch"}, {0: "batch", 1: "text"}, {0: "batch"}, {0: "batch"}), note="SD3 MMDiT: joint attention over image and text tokens")


def df_flux() -> ZooCase:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    m = FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1,
                               num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
                               joint_attention_dim=16, pooled_projection_dim=12,
                               guidance_embeds=False, axes_dims_rope=(2, 2, 4))
    img, txt = 16, 5
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0),
                                         indexing="ij"), -1).reshape(img, 3)
    return ZooCase(_eval(FluxSample(m)),
                   (_randn(B, img, 8), _randn(B, txt, 16, seed=1), _randn(B, 12, seed=2),
                    torch.tensor([0.3, 0.7]), img_ids, torch.zeros(txt, 3)), {},
                   ({0: "batch", 1: "image_tokens"}, {0: "batch", 1: "text"}, {0: "batch"},
                    {0: "batch"}, {0: "image_tokens"}, {0: "text"}),
                   note="Flux: double/single-stream blocks with 3-axis rotary embeddings")


# ---------------------------------------------------------------------------------------------
# torch-geometric
# ---------------------------------------------------------------------------------------------

def _graph(nodes: int = 10, edges: int = 24, feats: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = _g()
    x = torch.randn(nodes, feats, generator=g)
    ei = torch.randint(0, nodes, (2, edges), generator=g)
    return x, ei


class PygNet(nn.Module):
    def __init__(self, conv: Callable[[int, int], nn.Module]) -> None:
        super().__init__()
        self.c1 = conv(8, 16)
        self.c2 = conv(16, 4)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        return self.c2(self.c1(x, edge_index).relu(), edge_index)


def pyg(conv_name: str, note: str, **kw: Any) -> Callable[[], ZooCase]:
    def make() -> ZooCase:
        import torch_geometric.nn as gnn

        torch.manual_seed(0)
        cls = getattr(gnn, conv_name)
        if conv_name == "GINConv":
            def conv(i: int, o: int) -> nn.Module:
                return cls(nn.Sequential(nn.Linear(i, o), nn.ReLU(), nn.Linear(o, o)), **kw)
        else:
            def conv(i: int, o: int) -> nn.Module:
                return cls(i, o, **kw)
        return ZooCase(_eval(PygNet(conv)), _graph(), {},
                       ({0: "nodes"}, {1: "edges"}), note=note)

    return make


class PygPool(nn.Module):
    """GCN then a per-graph mean over a batch vector of a fixed number of graphs."""

    def __init__(self) -> None:
        super().__init__()
        from torch_geometric.nn import GCNConv

        self.conv = GCNConv(8, 16)
        self.fc = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor,
                batch: torch.Tensor) -> torch.Tensor:
        from torch_geometric.nn import global_mean_pool

        return self.fc(global_mean_pool(self.conv(x, edge_index).relu(), batch, size=2))


def pyg_pool() -> ZooCase:
    torch.manual_seed(0)
    x, ei = _graph()
    batch = torch.tensor([0] * 6 + [1] * 4)
    return ZooCase(_eval(PygPool()), (x, ei, batch), {}, ({0: "nodes"}, {1: "edges"},
                                                          {0: "nodes"}),
                   note="graph classification: GCN + global_mean_pool (scatter by batch vector)")


# ---------------------------------------------------------------------------------------------
# kornia
# ---------------------------------------------------------------------------------------------

class Fn(nn.Module):
    """A module around a plain function of an image (kornia's functional API)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> Any:
        return self.fn(x)


class Fn2(Fn):
    """A module around a plain function of an image and a second tensor."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:  # type: ignore[override]
        return self.fn(x, y)


IMG_DYN = ({0: "batch", 2: "height", 3: "width"},)


def kornia_case(build: Callable[[], nn.Module], note: str, size: tuple[int, int] = (24, 32),
                extra: Callable[[], tuple[Any, ...]] | None = None,
                extra_dyn: tuple[Any, ...] = ()) -> Callable[[], ZooCase]:
    def make() -> ZooCase:
        torch.manual_seed(0)
        x = torch.rand(B, 3, *size, generator=_g())
        args = (x,) + (extra() if extra else ())
        return ZooCase(_eval(build()), args, {}, IMG_DYN + extra_dyn, note=note)

    return make


def _kornia_hsv() -> nn.Module:
    import kornia

    return kornia.color.RgbToHsv()


def _kornia_blur() -> nn.Module:
    import kornia

    return kornia.filters.GaussianBlur2d((5, 5), (1.5, 1.5))


def _kornia_canny() -> nn.Module:
    import kornia

    return Fn(lambda x: kornia.filters.canny(x)[1])


def _kornia_rotate() -> nn.Module:
    import kornia

    return Fn(lambda x: kornia.geometry.transform.rotate(x, torch.full((x.shape[0],), 30.0)))


def _kornia_warp() -> nn.Module:
    import kornia

    return Fn2(lambda x, h: kornia.geometry.transform.warp_perspective(x, h, (24, 32)))


def _homography() -> tuple[torch.Tensor]:
    h = torch.eye(3).repeat(B, 1, 1)
    h[:, 0, 2] = torch.tensor([2.0, -3.0])
    h[:, 2, 0] = 1e-3
    return (h,)


def _kornia_sobel() -> nn.Module:
    import kornia

    return kornia.filters.Sobel()


def _kornia_lab() -> nn.Module:
    import kornia

    return kornia.color.RgbToLab()


# ---------------------------------------------------------------------------------------------
# monai
# ---------------------------------------------------------------------------------------------

def monai_case(build: Callable[[], nn.Module], shape: tuple[int, ...], note: str,
               dyn: dict[int, str] | None = None) -> Callable[[], ZooCase]:
    def make() -> ZooCase:
        torch.manual_seed(0)
        return ZooCase(_eval(build()), (_randn(*shape),), {}, (dyn or {0: "batch"},), note=note)

    return make


def _monai_unet() -> nn.Module:
    from monai.networks.nets import UNet

    return UNet(spatial_dims=2, in_channels=1, out_channels=2, channels=(8, 16, 32),
                strides=(2, 2), num_res_units=1)


def _monai_basic_unet() -> nn.Module:
    from monai.networks.nets import BasicUNet

    return BasicUNet(spatial_dims=2, in_channels=1, out_channels=2,
                     features=(4, 4, 8, 8, 16, 4))


def _monai_segresnet() -> nn.Module:
    from monai.networks.nets import SegResNet

    return SegResNet(spatial_dims=3, init_filters=8, in_channels=1, out_channels=2,
                     blocks_down=(1, 1, 1), blocks_up=(1, 1))


def _monai_swin_unetr() -> nn.Module:
    from monai.networks.nets import SwinUNETR

    return SwinUNETR(in_channels=1, out_channels=2, feature_size=12, depths=(1, 1, 1, 1),
                     num_heads=(1, 1, 2, 2), spatial_dims=2)


def _monai_unetr() -> nn.Module:
    from monai.networks.nets import UNETR

    return UNETR(in_channels=1, out_channels=2, img_size=(32, 32), feature_size=8,
                 hidden_size=48, mlp_dim=96, num_heads=4, spatial_dims=2)


def _monai_attention_unet() -> nn.Module:
    from monai.networks.nets import AttentionUnet

    return AttentionUnet(spatial_dims=2, in_channels=1, out_channels=2, channels=(8, 16, 32),
                         strides=(2, 2))


def _monai_densenet() -> nn.Module:
    from monai.networks.nets import DenseNet

    return DenseNet(spatial_dims=3, in_channels=1, out_channels=3, init_features=8,
                    growth_rate=4, block_config=(2, 2))


# ---------------------------------------------------------------------------------------------
# e3nn
# ---------------------------------------------------------------------------------------------

class E3Conv(nn.Module):
    """An equivariant point convolution: spherical harmonics of the edge vectors, a radial MLP
    giving tensor-product weights, messages summed onto the receiving nodes."""

    def __init__(self) -> None:
        super().__init__()
        from e3nn import o3
        from e3nn.nn import FullyConnectedNet

        self.irreps_in = o3.Irreps("4x0e + 2x1o")
        self.irreps_sh = o3.Irreps.spherical_harmonics(2)
        self.irreps_out = o3.Irreps("4x0e + 2x1o + 1x2e")
        self.tp = o3.FullyConnectedTensorProduct(self.irreps_in, self.irreps_sh, self.irreps_out,
                                                 shared_weights=False)
        self.fc = FullyConnectedNet([8, 16, self.tp.weight_numel], torch.relu)

    def forward(self, pos: torch.Tensor, feats: torch.Tensor,
                edge_index: torch.Tensor) -> torch.Tensor:
        from e3nn import o3
        from e3nn.math import soft_one_hot_linspace

        src, dst = edge_index[0], edge_index[1]
        vec = pos[dst] - pos[src]
        sh = o3.spherical_harmonics(self.irreps_sh, vec, normalize=True,
                                    normalization="component")
        emb = soft_one_hot_linspace(vec.norm(dim=1), 0.0, 3.0, 8, basis="smooth_finite",
                                    cutoff=True)
        msg = self.tp(feats[src], sh, self.fc(emb))
        out = torch.zeros(feats.shape[0], msg.shape[1], dtype=msg.dtype)
        return out.index_add(0, dst, msg)


def e3nn_conv() -> ZooCase:
    torch.manual_seed(0)
    pos = _randn(10, 3)
    feats = _randn(10, 10, seed=1)
    ei = torch.randint(0, 10, (2, 30), generator=_g(2))
    return ZooCase(_eval(E3Conv()), (pos, feats, ei), {}, ({0: "nodes"}, {0: "nodes"},
                                                           {1: "edges"}),
                   note="e3nn point convolution: spherical harmonics, radial basis, tensor "
                        "product, index_add aggregation")


class E3Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from e3nn import o3
        from e3nn.nn import Gate

        self.lin = o3.Linear("8x0e + 4x1o", "4x0e + 2x0e + 2x1o")
        self.gate = Gate("4x0e", [torch.tanh], "2x0e", [torch.sigmoid], "2x1o")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.lin(x))


def e3nn_gate() -> ZooCase:
    torch.manual_seed(0)
    return ZooCase(_eval(E3Gate()), (_randn(B, 20),), {}, ({0: "batch"},),
                   note="e3nn o3.Linear + gated nonlinearity")


class E3Rotate(nn.Module):
    """Rotates irreps features by Wigner-D matrices built from per-sample angles."""

    def __init__(self) -> None:
        super().__init__()
        from e3nn import o3

        self.irreps = o3.Irreps("2x0e + 1x1o + 1x2e")

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        d = self.irreps.D_from_angles(angles[:, 0], angles[:, 1], angles[:, 2])
        return torch.einsum("bij,bj->bi", d, x)


def e3nn_wigner() -> ZooCase:
    return ZooCase(_eval(E3Rotate()), (_randn(B, 10), _randn(B, 3, seed=1)), {},
                   ({0: "batch"}, {0: "batch"}),
                   note="e3nn Wigner-D rotations from Euler angles (complex intermediates)")


# ---------------------------------------------------------------------------------------------
# gpytorch
# ---------------------------------------------------------------------------------------------

class GPMean(nn.Module):
    """An exact GP's predictive mean and variance at test points (training data fixed)."""

    def __init__(self) -> None:
        super().__init__()
        import gpytorch

        train_x = torch.linspace(0, 1, 20).unsqueeze(-1)
        train_y = torch.sin(train_x[:, 0] * 6.0)

        class Exact(gpytorch.models.ExactGP):
            def __init__(self) -> None:
                super().__init__(train_x, train_y, gpytorch.likelihoods.GaussianLikelihood())
                self.mean_module = gpytorch.means.ConstantMean()
                self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

            def forward(self, x: torch.Tensor) -> Any:
                return gpytorch.distributions.MultivariateNormal(self.mean_module(x),
                                                                 self.covar_module(x))

        self.gp = Exact().eval()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        import gpytorch

        with gpytorch.settings.fast_pred_var(False), gpytorch.settings.skip_posterior_variances(
                False):
            post = self.gp(x)
            return post.mean, post.variance


def gp_exact() -> ZooCase:
    torch.manual_seed(0)
    return ZooCase(GPMean(), (torch.rand(7, 1, generator=_g()),), {}, ({0: "points"},),
                   note="gpytorch exact GP prediction (Cholesky with jitter retries)")


class SVGP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        import gpytorch

        class Model(gpytorch.models.ApproximateGP):
            def __init__(self) -> None:
                inducing = torch.linspace(0, 1, 8).unsqueeze(-1)
                dist = gpytorch.variational.CholeskyVariationalDistribution(8)
                strat = gpytorch.variational.VariationalStrategy(
                    self, inducing, dist, learn_inducing_locations=True)
                super().__init__(strat)
                self.mean_module = gpytorch.means.ConstantMean()
                self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

            def forward(self, x: torch.Tensor) -> Any:
                return gpytorch.distributions.MultivariateNormal(self.mean_module(x),
                                                                 self.covar_module(x))

        self.gp = Model().eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gp(x).mean


def gp_svgp() -> ZooCase:
    torch.manual_seed(0)
    model = SVGP()
    # a trained model's state: the variational mean set, the initialised flag on (untrained,
    # the first call initialises it with random noise, and the predictive mean is that noise)
    with torch.no_grad():
        strat = model.gp.variational_strategy
        strat._variational_distribution.variational_mean.copy_(
            torch.sin(6 * torch.linspace(0, 1, 8)))
        strat.variational_params_initialized.fill_(1)
    return ZooCase(model, (torch.rand(7, 1, generator=_g()),), {}, ({0: "points"},),
                   note="gpytorch SVGP predictive mean (variational strategy, Cholesky)")


# ---------------------------------------------------------------------------------------------
# flows and distributions: zuko, nflows, pyro
# ---------------------------------------------------------------------------------------------

class LogProb(nn.Module):
    """log p(x) of a (conditional) flow or distribution built by ``flow()``."""

    def __init__(self, flow: nn.Module) -> None:
        super().__init__()
        self.flow = flow

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.flow().log_prob(x)


def zuko_flow(name: str, note: str, **kw: Any) -> Callable[[], ZooCase]:
    def make() -> ZooCase:
        import zuko

        torch.manual_seed(0)
        flow = getattr(zuko.flows, name)(features=3, context=0, transforms=2,
                                         hidden_features=(16, 16), **kw)
        return ZooCase(_eval(LogProb(flow)), (_randn(B * 3, 3),), {}, ({0: "batch"},),
                       note=note)

    return make


class NflowsLogProb(nn.Module):
    def __init__(self, flow: nn.Module) -> None:
        super().__init__()
        self.flow = flow

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.flow.log_prob(x)


def nflows_maf() -> ZooCase:
    from nflows.distributions.normal import StandardNormal
    from nflows.flows.base import Flow
    from nflows.transforms.autoregressive import MaskedAffineAutoregressiveTransform
    from nflows.transforms.base import CompositeTransform
    from nflows.transforms.permutations import ReversePermutation

    torch.manual_seed(0)
    t = CompositeTransform([MaskedAffineAutoregressiveTransform(4, 16), ReversePermutation(4),
                            MaskedAffineAutoregressiveTransform(4, 16)])
    flow = Flow(t, StandardNormal([4]))
    return ZooCase(_eval(NflowsLogProb(flow)), (_randn(6, 4),), {}, ({0: "batch"},),
                   note="nflows masked autoregressive flow log-density")


def nflows_spline() -> ZooCase:
    from nflows.distributions.normal import StandardNormal
    from nflows.flows.base import Flow
    from nflows.nn.nets import ResidualNet
    from nflows.transforms.coupling import PiecewiseRationalQuadraticCouplingTransform

    torch.manual_seed(0)
    mask = torch.tensor([1, 0, 1, 0])

    def net(i: int, o: int) -> nn.Module:
        return ResidualNet(i, o, hidden_features=16, num_blocks=1)

    t = PiecewiseRationalQuadraticCouplingTransform(mask, net, num_bins=4, tails="linear",
                                                    tail_bound=3.0)
    flow = Flow(t, StandardNormal([4]))
    return ZooCase(_eval(NflowsLogProb(flow)), (_randn(6, 4),), {}, ({0: "batch"},),
                   note="nflows rational-quadratic spline coupling (bin search, tail masks)")


class PyroStudentT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(3))
        self.scale_tril = nn.Parameter(torch.eye(3) + 0.1 * torch.tril(torch.ones(3, 3), -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import pyro.distributions as dist

        return dist.MultivariateStudentT(torch.tensor(4.0), self.loc,
                                         self.scale_tril).log_prob(x)


def pyro_student_t() -> ZooCase:
    return ZooCase(_eval(PyroStudentT()), (_randn(5, 3),), {}, ({0: "batch"},),
                   note="pyro MultivariateStudentT log-density (argument validation asserts)")


class PyroMixture(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.tensor([0.1, -0.3, 0.5]))
        self.loc = nn.Parameter(torch.tensor([[-1.0, 0.0], [0.5, 1.0], [2.0, -1.0]]))
        self.log_scale = nn.Parameter(torch.zeros(3, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import pyro.distributions as dist

        comp = dist.Normal(self.loc, self.log_scale.exp()).to_event(1)
        return dist.MixtureSameFamily(dist.Categorical(logits=self.logits), comp).log_prob(x)


def pyro_mixture() -> ZooCase:
    return ZooCase(_eval(PyroMixture()), (_randn(5, 2),), {}, ({0: "batch"},),
                   note="pyro Gaussian mixture log-density (to_event, MixtureSameFamily)")


# ---------------------------------------------------------------------------------------------
# ODE solvers: torchdiffeq, torchcde
# ---------------------------------------------------------------------------------------------

class ODEFunc(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.net(y)


class ODEBlock(nn.Module):
    def __init__(self, method: str, **options: Any) -> None:
        super().__init__()
        self.f = ODEFunc()
        self.method = method
        self.options = options
        self.register_buffer("t", torch.tensor([0.0, 1.0]))

    def forward(self, y0: torch.Tensor) -> torch.Tensor:
        from torchdiffeq import odeint

        return odeint(self.f, y0, self.t, method=self.method, **self.options)[-1]


def ode_rk4() -> ZooCase:
    torch.manual_seed(0)
    return ZooCase(_eval(ODEBlock("rk4", options={"step_size": 0.25})), (_randn(B, 4),), {},
                   ({0: "batch"},), note="torchdiffeq fixed-step RK4 (4 steps)")


def ode_dopri5() -> ZooCase:
    torch.manual_seed(0)
    return ZooCase(_eval(ODEBlock("dopri5", rtol=1e-3, atol=1e-4)), (_randn(B, 4),), {},
                   ({0: "batch"},),
                   note="torchdiffeq adaptive Dormand-Prince (data-dependent step count)")


class CDE(nn.Module):
    """A neural CDE on a natural cubic spline of the observations (torchcde)."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8 * 3))
        self.init = nn.Linear(3, 8)

    def forward(self, coeffs: torch.Tensor) -> torch.Tensor:
        import torchcde

        x = torchcde.CubicSpline(coeffs)
        z0 = self.init(x.evaluate(x.interval[0]))

        def func(t: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
            return self.f(z).view(z.shape[0], 8, 3)

        class F(nn.Module):
            def forward(self, t: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
                return func(t, z)

        return torchcde.cdeint(X=x, func=F(), z0=z0, t=x.interval, method="rk4",
                               options={"step_size": 1.0})[:, -1]


def cde() -> ZooCase:
    import torchcde

    torch.manual_seed(0)
    t = torch.linspace(0, 4, 5)
    path = torch.cat([t.expand(B, 5).unsqueeze(-1), _randn(B, 5, 2)], -1)
    coeffs = torchcde.natural_cubic_coeffs(path)
    return ZooCase(_eval(CDE()), (coeffs,), {}, ({0: "batch"},),
                   note="torchcde neural CDE over cubic-spline coefficients (RK4)")


# ---------------------------------------------------------------------------------------------
# sentence-transformers
# ---------------------------------------------------------------------------------------------

class _HFEncoder(nn.Module):
    """The token-embedding module of a SentenceTransformer, on a BERT built from a config."""

    def __init__(self) -> None:
        super().__init__()
        self.bert = _hf("bert", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, vocab_size=128, max_position_embeddings=64)

    def forward(self, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = self.bert(input_ids=features["input_ids"],
                        attention_mask=features["attention_mask"]).last_hidden_state
        return {**features, "token_embeddings": out}


class SentenceEmbedding(nn.Module):
    def __init__(self, mode: str, normalize: bool) -> None:
        super().__init__()
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.models import Normalize, Pooling

        mods: list[nn.Module] = [_HFEncoder(), Pooling(32, pooling_mode=mode)]
        if normalize:
            mods.append(Normalize())
        self.st = SentenceTransformer(modules=mods, device="cpu")

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.st({"input_ids": input_ids, "attention_mask": attention_mask})[
            "sentence_embedding"]


def sentence(mode: str, normalize: bool, note: str) -> Callable[[], ZooCase]:
    def make() -> ZooCase:
        torch.manual_seed(0)
        ids = torch.randint(4, 128, (B, 9), generator=_g())
        mask = torch.ones_like(ids)
        mask[1, 6:] = 0
        return ZooCase(_eval(SentenceEmbedding(mode, normalize)), (ids, mask), {},
                       ({0: "batch", 1: "seq"}, {0: "batch", 1: "seq"}), note=note)

    return make


# ---------------------------------------------------------------------------------------------
# einops-based and small research libraries
# ---------------------------------------------------------------------------------------------

class EinopsViT(nn.Module):
    """A ViT written the einops way (vit-pytorch style): rearrange patches, Rearrange heads."""

    def __init__(self, dim: int = 32, patch: int = 4) -> None:
        super().__init__()
        from einops.layers.torch import Rearrange

        self.to_patch = nn.Sequential(
            Rearrange("b c (h p1) (w p2) -> b (h w) (p1 p2 c)", p1=patch, p2=patch),
            nn.LayerNorm(patch * patch * 3), nn.Linear(patch * patch * 3, dim))
        self.qkv = nn.Linear(dim, dim * 3)
        self.out = nn.Linear(dim, dim)
        self.heads = 4

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        from einops import rearrange, reduce

        x = self.to_patch(img)
        q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=self.heads)
                   for t in self.qkv(x).chunk(3, -1))
        att = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)
        x = x + self.out(rearrange(att @ v, "b h n d -> b n (h d)"))
        return reduce(x, "b n d -> b d", "mean")


def einops_vit() -> ZooCase:
    torch.manual_seed(0)
    return ZooCase(_eval(EinopsViT()), (_randn(B, 3, 16, 24),), {}, IMG_DYN,
                   note="einops rearrange/reduce ViT with patch counts from the image size")


class XDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from x_transformers import Decoder, TransformerWrapper

        self.m = TransformerWrapper(num_tokens=64, max_seq_len=32,
                                    attn_layers=Decoder(dim=32, depth=2, heads=2,
                                                        rotary_pos_emb=True))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.m(ids, mask=mask)


def x_decoder() -> ZooCase:
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (B, 10), generator=_g())
    mask = torch.ones(B, 10, dtype=torch.bool)
    mask[1, 7:] = False
    return ZooCase(_eval(XDecoder()), (ids, mask), {},
                   ({0: "batch", 1: "seq"}, {0: "batch", 1: "seq"}),
                   note="x-transformers decoder with rotary embeddings and a padding mask")


class VQ(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from vector_quantize_pytorch import ResidualVQ

        self.vq = ResidualVQ(dim=16, num_quantizers=2, codebook_size=32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, idx, _ = self.vq(x)
        return q, idx


def vq_residual() -> ZooCase:
    torch.manual_seed(0)
    return ZooCase(_eval(VQ()), (_randn(B, 12, 16),), {}, ({0: "batch", 1: "seq"},),
                   note="vector-quantize-pytorch residual VQ (nearest code: cdist + argmin)")


class RotaryAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from rotary_embedding_torch import RotaryEmbedding

        self.rot = RotaryEmbedding(dim=8)
        self.qkv = nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        q = self.rot.rotate_queries_or_keys(q)
        k = self.rot.rotate_queries_or_keys(k)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(b, n, 32)


def rotary_attention() -> ZooCase:
    torch.manual_seed(0)
    return ZooCase(_eval(RotaryAttention()), (_randn(B, 10, 32),), {}, ({0: "batch", 1: "seq"},),
                   note="rotary-embedding-torch (frequencies cached per length) + causal SDPA")


class NormflowsLogProb(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        import normflows as nf

        flows: list[nn.Module] = []
        for i in range(4):
            mask = torch.tensor([(j + i) % 2 for j in range(4)], dtype=torch.float32)
            flows.append(nf.flows.MaskedAffineFlow(
                mask, nf.nets.MLP([4, 16, 4], init_zeros=False),
                nf.nets.MLP([4, 16, 4], init_zeros=False)))
            flows.append(nf.flows.ActNorm(4))
        self.flow = nf.NormalizingFlow(nf.distributions.DiagGaussian(4), flows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.flow.log_prob(x)


def normflows_realnvp() -> ZooCase:
    torch.manual_seed(0)
    m = NormflowsLogProb()
    m.flow.log_prob(_randn(16, 4, seed=5))  # ActNorm initialises itself on its first batch
    return ZooCase(_eval(m), (_randn(6, 4),), {}, ({0: "batch"},),
                   note="normflows RealNVP (masked affine coupling + ActNorm) log-density")


def neuralop_fno() -> ZooCase:
    from neuralop.models import FNO

    torch.manual_seed(0)
    m = FNO(n_modes=(4, 4), hidden_channels=8, in_channels=1, out_channels=1, n_layers=2)
    return ZooCase(_eval(m), (_randn(B, 1, 16, 16),), {}, IMG_DYN,
                   note="neuraloperator FNO (spectral convolutions, complex weights)")


class SincNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from asteroid_filterbanks import Encoder, ParamSincFB

        self.enc = Encoder(ParamSincFB(16, 33, stride=8, sample_rate=8000))

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return self.enc(wav)


def sincnet() -> ZooCase:
    return ZooCase(_eval(SincNet()), (_randn(B, 1, 800),), {}, ({0: "batch", 2: "samples"},),
                   note="asteroid-filterbanks parametrised sinc filterbank (SincNet)")


class Resample(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        import julius

        self.r = julius.ResampleFrac(4, 3)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return self.r(wav)


def julius_resample() -> ZooCase:
    return ZooCase(_eval(Resample()), (_randn(B, 400),), {}, ({0: "batch", 1: "samples"},),
                   note="julius fractional resampling 4:3 (sinc filters, strided conv)")


def julius_lowpass() -> ZooCase:
    import julius

    return ZooCase(_eval(julius.LowPassFilters([0.1, 0.25])), (_randn(B, 400),), {},
                   ({0: "batch", 1: "samples"},),
                   note="julius low-pass filter bank (FFT convolution above a size)")


# ---------------------------------------------------------------------------------------------
# the zoo
# ---------------------------------------------------------------------------------------------

ZOO: dict[str, Callable[[], ZooCase]] = {
    # torch.nn builtins
    "nn/transformer_masked": nn_transformer,
    "nn/mha_masked": nn_mha,
    "nn/encoder_fastpath": nn_encoder_fastpath,
    "nn/bilstm": nn_bilstm,
    "nn/packed_gru": nn_packed_gru,
    "nn/packed_bilstm": nn_packed_bilstm,
    "nn/stft_logmel": nn_stft_logmel,
    "nn/stn_grid_sample": nn_stn,
    "nn/embedding_bag": nn_embedding_bag,
    "nn/pixel_shuffle": nn_pixel_shuffle,
    "nn/fourier_layer": nn_fourier_layer,
    # transformers: MoE, state-space, audio codecs
    "transformers/mixtral": hf_text("mixtral", "sparse mixture of experts (top-2 routing)",
                                    num_local_experts=4, num_experts_per_tok=2),
    "transformers/qwen2_moe": hf_text("qwen2_moe", "MoE with a shared expert",
                                      num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32,
                                      shared_expert_intermediate_size=32),
    "transformers/mamba": hf_mamba,
    "transformers/encodec": hf_encodec,
    "transformers/dac": hf_dac,
    # diffusers
    "diffusers/unet2d": df_unet2d,
    "diffusers/unet2d_condition": df_unet2d_cond,
    "diffusers/vae": df_vae,
    "diffusers/dit": df_dit,
    "diffusers/sd3_transformer": df_sd3,
    "diffusers/flux_transformer": df_flux,
    # torch-geometric
    "pyg/gcn": pyg("GCNConv", "GCN: normalised adjacency by scatter-add over edges"),
    "pyg/gat": pyg("GATConv", "GAT: per-edge attention, softmax over each node's edges",
                   heads=1),
    "pyg/sage": pyg("SAGEConv", "GraphSAGE mean aggregation"),
    "pyg/gin": pyg("GINConv", "GIN: sum aggregation and an MLP"),
    "pyg/transformer_conv": pyg("TransformerConv", "graph transformer convolution", heads=2,
                                concat=False),
    "pyg/global_pool": pyg_pool,
    # kornia
    "kornia/rgb_to_hsv": kornia_case(_kornia_hsv, "colour conversion RGB->HSV"),
    "kornia/rgb_to_lab": kornia_case(_kornia_lab, "colour conversion RGB->Lab (piecewise)"),
    "kornia/gaussian_blur": kornia_case(_kornia_blur, "separable Gaussian blur"),
    "kornia/sobel": kornia_case(_kornia_sobel, "Sobel gradient magnitude"),
    "kornia/canny": kornia_case(_kornia_canny, "Canny edges (NMS and hysteresis by convs)"),
    "kornia/rotate": kornia_case(_kornia_rotate, "rotation by an affine warp"),
    "kornia/warp_perspective": kornia_case(_kornia_warp, "homography warp (grid + grid_sample)",
                                           extra=_homography, extra_dyn=({0: "batch"},)),
    # monai
    "monai/unet": monai_case(_monai_unet, (B, 1, 32, 32), "2-D residual UNet",
                             {0: "batch", 2: "height", 3: "width"}),
    "monai/basic_unet": monai_case(_monai_basic_unet, (B, 1, 32, 32), "2-D BasicUNet (instance norm)",
                                   {0: "batch", 2: "height", 3: "width"}),
    "monai/segresnet": monai_case(_monai_segresnet, (B, 1, 16, 16, 16),
                                  "3-D SegResNet (group norm, trilinear upsampling)"),
    "monai/swin_unetr": monai_case(_monai_swin_unetr, (B, 1, 64, 64),
                                   "SwinUNETR 2-D (shifted windows, padding to windows)"),
    "monai/unetr": monai_case(_monai_unetr, (B, 1, 32, 32), "UNETR 2-D (ViT encoder)"),
    "monai/attention_unet": monai_case(_monai_attention_unet, (B, 1, 32, 32),
                                       "attention-gated UNet",
                                       {0: "batch", 2: "height", 3: "width"}),
    "monai/densenet3d": monai_case(_monai_densenet, (B, 1, 16, 16, 16), "3-D DenseNet"),
    # e3nn
    "e3nn/point_conv": e3nn_conv,
    "e3nn/gate": e3nn_gate,
    "e3nn/wigner_rotation": e3nn_wigner,
    # gpytorch
    "gpytorch/exact_gp": gp_exact,
    "gpytorch/svgp": gp_svgp,
    # flows and distributions
    "zuko/maf": zuko_flow("MAF", "zuko masked autoregressive flow log-density"),
    "zuko/nsf": zuko_flow("NSF", "zuko neural spline flow (monotonic rational-quadratic)"),
    "zuko/unaf": zuko_flow("UNAF", "zuko unconstrained monotonic neural flow (integration)"),
    "nflows/maf": nflows_maf,
    "nflows/spline_coupling": nflows_spline,
    "pyro/student_t": pyro_student_t,
    "pyro/mixture": pyro_mixture,
    # ODE solvers
    "torchdiffeq/rk4": ode_rk4,
    "torchdiffeq/dopri5": ode_dopri5,
    "torchcde/cde": cde,
    # sentence-transformers
    "sentence_transformers/mean_pool": sentence("mean", True,
                                                "BERT + masked mean pooling + L2 normalise"),
    "sentence_transformers/cls_pool": sentence("cls", False, "BERT + CLS-token pooling"),
    # einops-based and research libraries
    "einops/vit": einops_vit,
    "x_transformers/decoder": x_decoder,
    "vector_quantize/residual_vq": vq_residual,
    "rotary_embedding/attention": rotary_attention,
    "normflows/realnvp": normflows_realnvp,
    "neuralop/fno": neuralop_fno,
    "asteroid_filterbanks/sincnet": sincnet,
    "julius/resample_frac": julius_resample,
    "julius/lowpass": julius_lowpass,
}

# the subset the default tests export (seconds each): a masked nn builtin, a graph net, an image
# op library and a flow (their libraries are in the test extra)
FAST = ["nn/mha_masked", "pyg/gcn", "kornia/rgb_to_hsv", "zuko/maf"]

ALL: dict[str, Callable[[], ZooCase]] = {
    **{name: with_size_check(make) for name, make in ZOO.items()},
    **{f"{name}@Dim": with_size_check(make, dims=True) for name, make in ZOO.items()}}
