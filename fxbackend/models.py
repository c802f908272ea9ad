"""Single table of real diffusers model configs used by tests, the demo and benchmarks.

Every entry of ``MODEL_CONFIGS`` is keyed by ``(family, size)`` and is plain data:

* ``cls``: name of the diffusers model class,
* ``config``: constructor kwargs (real architecture, scaled down, random weights),
* ``inputs``: input description (``batch``, latent ``resolutions`` as ``(h, w)``, ``text_len``
  and family-specific extras). ``resolutions`` is ``[default square, other square, non-square]``:
  the first two differ only in size (a dynamic-shape compile should not need to recompile), the
  third catches height/width mix-ups (duck sizing guards ``h == w``, so it may recompile).

Families: ``flux`` (double- + single-stream MMDiT with 3-axis RoPE), ``sd3`` (joint-attention
MMDiT, SD3.5-style QK RMSNorm), ``pixart`` (DiT with adaLN-single and cross-attention),
``unet`` (SD-style UNet2DConditionModel with GroupNorm resnets and cross-attention blocks),
``wan`` (WanTransformer3DModel: video latents, 3-axis RoPE, cross-attention) and
``sdxl`` (SDXL-style UNet2DConditionModel: linear projections, multi-layer transformer blocks,
text/time added conditioning) and ``vae`` (SD-style AutoencoderKL, encode and decode; its
``resolutions`` are image sizes).  Sizes: ``tiny`` (a few ms per call, quick to
compile; for tests) and ``small`` (roughly 100-350 ms per float32 forward on a 2-core CPU; for
benchmarks).

diffusers is imported lazily, so importing this module is cheap. Run it as a script to build
every entry and print output shapes, magnitudes and eager timings.
"""

import time

import torch

MODEL_CONFIGS = {
    # FLUX.1-dev layout: in_channels = 4 * latent channels (2x2 packing), RoPE axes sum to head dim.
    ("flux", "tiny"): {
        "cls": "FluxTransformer2DModel",
        "config": dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                       attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                       pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6)),
        "inputs": dict(batch=1, resolutions=[(16, 16), (24, 24), (16, 24)], text_len=7, guidance=4.0),
    },
    # FLUX.1-schnell style (no guidance embedding), wider and more tokens.
    ("flux", "small"): {
        "cls": "FluxTransformer2DModel",
        "config": dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=2,
                       attention_head_dim=64, num_attention_heads=6, joint_attention_dim=256,
                       pooled_projection_dim=128, guidance_embeds=False, axes_dims_rope=(8, 28, 28)),
        "inputs": dict(batch=1, resolutions=[(64, 64), (48, 48), (48, 80)], text_len=77),
    },
    # SD3.5 layout: QK RMSNorm, dual attention in the first block, last block context_pre_only.
    ("sd3", "tiny"): {
        "cls": "SD3Transformer2DModel",
        "config": dict(sample_size=16, patch_size=2, in_channels=4, num_layers=2,
                       attention_head_dim=8, num_attention_heads=4, joint_attention_dim=32,
                       caption_projection_dim=32, pooled_projection_dim=64, out_channels=4,
                       pos_embed_max_size=32, dual_attention_layers=(0,), qk_norm="rms_norm"),
        "inputs": dict(batch=1, resolutions=[(16, 16), (24, 24), (16, 24)], text_len=7),
    },
    ("sd3", "small"): {
        "cls": "SD3Transformer2DModel",
        "config": dict(sample_size=64, patch_size=2, in_channels=16, num_layers=3,
                       attention_head_dim=64, num_attention_heads=8, joint_attention_dim=256,
                       caption_projection_dim=512, pooled_projection_dim=128, out_channels=16,
                       pos_embed_max_size=96, dual_attention_layers=(), qk_norm="rms_norm"),
        "inputs": dict(batch=1, resolutions=[(64, 64), (48, 48), (48, 80)], text_len=77),
    },
    # PixArt-Sigma layout: adaLN-single, caption projection, learned sigma (out = 2 * in).
    # sample_size is not among the resolutions: PatchEmbed takes a different branch at the native
    # size, so keeping all runs off it avoids a dynamo guard flip between resolutions.
    ("pixart", "tiny"): {
        "cls": "PixArtTransformer2DModel",
        "config": dict(sample_size=16, patch_size=2, in_channels=4, out_channels=8, num_layers=2,
                       num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
                       caption_channels=32, norm_type="ada_norm_single",
                       num_embeds_ada_norm=1000, use_additional_conditions=False),
        "inputs": dict(batch=1, resolutions=[(8, 8), (12, 12), (8, 12)], text_len=7),
    },
    ("pixart", "small"): {
        "cls": "PixArtTransformer2DModel",
        "config": dict(sample_size=128, patch_size=2, in_channels=4, out_channels=8, num_layers=3,
                       num_attention_heads=8, attention_head_dim=64, cross_attention_dim=512,
                       caption_channels=512, norm_type="ada_norm_single",
                       num_embeds_ada_norm=1000, use_additional_conditions=False),
        "inputs": dict(batch=1, resolutions=[(64, 64), (48, 48), (48, 80)], text_len=77),
    },
    # SD1.x layout (cross-attn down blocks, plain lowest-res block, mirrored up path), fewer levels.
    # Square resolutions stay on one side of the CPU conv-backend size heuristic (20480 input
    # elements, torch._C._select_conv_backend), which dynamo otherwise guards on.
    ("unet", "tiny"): {
        "cls": "UNet2DConditionModel",
        "config": dict(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
                       block_out_channels=(16, 32),
                       down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                       mid_block_type="UNetMidBlock2DCrossAttn",
                       up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
                       cross_attention_dim=32, attention_head_dim=2, norm_num_groups=8),
        "inputs": dict(batch=1, resolutions=[(16, 16), (20, 20), (16, 24)], text_len=7),
    },
    ("unet", "small"): {
        "cls": "UNet2DConditionModel",
        "config": dict(sample_size=32, in_channels=4, out_channels=4, layers_per_block=1,
                       block_out_channels=(128, 256, 256),
                       down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
                       mid_block_type="UNetMidBlock2DCrossAttn",
                       up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
                       cross_attention_dim=256, attention_head_dim=4, norm_num_groups=32),
        "inputs": dict(batch=1, resolutions=[(40, 40), (36, 36), (32, 48)], text_len=77),
    },
    # Wan 2.1 layout: video latents (frames x h x w) in 1x2x2 patches, 3-axis RoPE, RMSNorm
    # across heads for q/k, cross-attention to the text, adaLN modulation from a table.
    ("wan", "tiny"): {
        "cls": "WanTransformer3DModel",
        "config": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                       in_channels=4, out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32,
                       num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                       rope_max_seq_len=32),
        "inputs": dict(batch=1, resolutions=[(16, 16), (20, 20), (16, 24)], text_len=7,
                       frames=2),
    },
    ("wan", "small"): {
        "cls": "WanTransformer3DModel",
        "config": dict(patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=64,
                       in_channels=16, out_channels=16, text_dim=256, freq_dim=256,
                       ffn_dim=2048, num_layers=2, cross_attn_norm=True,
                       qk_norm="rms_norm_across_heads", rope_max_seq_len=1024),
        "inputs": dict(batch=1, resolutions=[(48, 48), (40, 40), (32, 48)], text_len=77,
                       frames=3),
    },
    # SDXL layout: linear-projection transformers with several layers in the deeper block,
    # added conditioning (pooled text embeddings + size/crop time ids, "text_time").
    ("sdxl", "tiny"): {
        "cls": "UNet2DConditionModel",
        "config": dict(sample_size=32, in_channels=4, out_channels=4, layers_per_block=2,
                       block_out_channels=(32, 64),
                       down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                       up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
                       attention_head_dim=(2, 4), use_linear_projection=True,
                       addition_embed_type="text_time", addition_time_embed_dim=8,
                       transformer_layers_per_block=(1, 2),
                       projection_class_embeddings_input_dim=80, cross_attention_dim=64,
                       norm_num_groups=32),
        "inputs": dict(batch=1, resolutions=[(16, 16), (20, 20), (16, 24)], text_len=7,
                       text_embeds=32),
    },
    ("sdxl", "small"): {
        "cls": "UNet2DConditionModel",
        "config": dict(sample_size=32, in_channels=4, out_channels=4, layers_per_block=2,
                       block_out_channels=(128, 256),
                       down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                       up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
                       attention_head_dim=(2, 4), use_linear_projection=True,
                       addition_embed_type="text_time", addition_time_embed_dim=32,
                       transformer_layers_per_block=(1, 2),
                       projection_class_embeddings_input_dim=448, cross_attention_dim=256,
                       norm_num_groups=32),
        "inputs": dict(batch=1, resolutions=[(32, 32), (28, 28), (24, 32)], text_len=77,
                       text_embeds=256),
    },
    # SD-style VAE (AutoencoderKL): encode, the posterior's mode, decode; a convolutional
    # network with GroupNorm resnets, a mid-block attention over pixels, down- and upsampling.
    # ``resolutions`` are image sizes here (3 channels), not latents.
    ("vae", "tiny"): {
        "cls": "AutoencoderKL",
        "config": dict(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1,
                       block_out_channels=(32, 64),
                       down_block_types=("DownEncoderBlock2D",) * 2,
                       up_block_types=("UpDecoderBlock2D",) * 2,
                       norm_num_groups=32, sample_size=32),
        "inputs": dict(batch=1, resolutions=[(32, 32), (48, 48), (32, 48)], text_len=0),
    },
    ("vae", "small"): {
        "cls": "AutoencoderKL",
        "config": dict(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1,
                       block_out_channels=(64, 128, 256),
                       down_block_types=("DownEncoderBlock2D",) * 3,
                       up_block_types=("UpDecoderBlock2D",) * 3,
                       norm_num_groups=32, sample_size=96),
        "inputs": dict(batch=1, resolutions=[(96, 96), (80, 80), (64, 96)], text_len=0),
    },
}


def families():
    """Return the model families in table order (``flux``, ``sd3``, ``pixart``, ``unet``, ...)."""
    return list(dict.fromkeys(f for f, _ in MODEL_CONFIGS))


def sizes():
    """Return the model sizes in table order (``tiny``, ``small``)."""
    return list(dict.fromkeys(s for _, s in MODEL_CONFIGS))


def _entry(family, size):
    try:
        return MODEL_CONFIGS[(family, size)]
    except KeyError:
        raise KeyError(f"unknown model {(family, size)!r}; known: {sorted(MODEL_CONFIGS)}") from None


@torch.no_grad()
def _rerandomize(model, seed):
    """Overwrite every parameter with deterministic small normal values (no zero-init gates)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        val = torch.randn(p.shape, generator=gen)
        if p.dim() >= 2:  # linear / conv / tables: fan-in scaled, capped, so activations stay O(1)
            val *= min(0.3, p[0].numel() ** -0.5)
        elif name.endswith("weight"):  # norm scales around 1
            val = 1.0 + 0.1 * val
        else:  # biases
            val *= 0.02
        p.copy_(val)


def build_model(family, size, dtype=torch.float32, device="cpu", seed=0):
    """Build ``(family, size)`` from its config with deterministic random weights, in eval mode.

    Weights are created on CPU in float32 (``torch.manual_seed(seed)`` before construction), then
    every parameter is re-randomised from a generator seeded with ``seed`` (so zero-initialised
    gates / output layers do not make outputs trivial), then moved to ``device``/``dtype``.
    """
    import diffusers

    entry = _entry(family, size)
    torch.manual_seed(seed)
    model = getattr(diffusers, entry["cls"])(**entry["config"])
    _rerandomize(model, seed)
    # nn.Module.to: diffusers' ModelMixin.to warns about fp32-kept modules on every dtype cast.
    return torch.nn.Module.to(model, device=device, dtype=dtype).eval()


def _resolution(entry, resolution):
    res = entry["inputs"]["resolutions"][0] if resolution is None else resolution
    return (res, res) if isinstance(res, int) else tuple(res)


def make_inputs(family, size, resolution=None, batch=None, dtype=torch.float32, device="cpu", seed=0):
    """Return deterministic forward kwargs (always ``return_dict=False``) for ``(family, size)``.

    ``resolution`` is the latent spatial size ``(h, w)`` (or an int for square); defaults to the
    first entry of the config's ``resolutions``. ``batch`` defaults to the config's batch.
    """
    entry = _entry(family, size)
    cfg, spec = entry["config"], entry["inputs"]
    h, w = _resolution(entry, resolution)
    b = spec["batch"] if batch is None else batch
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)

    def full(value):
        return torch.full((b,), float(value), device=device, dtype=dtype)

    n_txt = spec["text_len"]
    if family == "flux":
        assert h % 2 == 0 and w % 2 == 0, "flux latents are packed 2x2"
        ids = torch.zeros(h // 2, w // 2, 3)  # like FluxPipeline._prepare_latent_image_ids
        ids[..., 1] += torch.arange(h // 2)[:, None]
        ids[..., 2] += torch.arange(w // 2)[None, :]
        kw = dict(hidden_states=randn(b, (h // 2) * (w // 2), cfg["in_channels"]),
                  encoder_hidden_states=randn(b, n_txt, cfg["joint_attention_dim"]),
                  pooled_projections=randn(b, cfg["pooled_projection_dim"]),
                  timestep=full(0.5),  # the pipeline passes t / 1000
                  img_ids=ids.reshape(-1, 3).to(device=device, dtype=dtype).clone(),  # not a view
                  txt_ids=torch.zeros(n_txt, 3, device=device, dtype=dtype))
        if cfg.get("guidance_embeds"):
            kw["guidance"] = full(spec.get("guidance", 4.0))  # 4000 is exact in bf16
    elif family == "sd3":
        kw = dict(hidden_states=randn(b, cfg["in_channels"], h, w),
                  encoder_hidden_states=randn(b, n_txt, cfg["joint_attention_dim"]),
                  pooled_projections=randn(b, cfg["pooled_projection_dim"]),
                  timestep=full(500))
    elif family == "pixart":
        kw = dict(hidden_states=randn(b, cfg["in_channels"], h, w),
                  encoder_hidden_states=randn(b, n_txt, cfg["caption_channels"]),
                  timestep=full(500),
                  added_cond_kwargs={"resolution": None, "aspect_ratio": None})
    elif family == "unet":
        kw = dict(sample=randn(b, cfg["in_channels"], h, w), timestep=full(500),
                  encoder_hidden_states=randn(b, n_txt, cfg["cross_attention_dim"]))
    elif family == "sdxl":
        # time_ids: original size, crop top-left, target size (SDXL's micro-conditioning)
        ids = torch.tensor([8.0 * h, 8.0 * w, 0.0, 0.0, 8.0 * h, 8.0 * w])
        kw = dict(sample=randn(b, cfg["in_channels"], h, w), timestep=full(500),
                  encoder_hidden_states=randn(b, n_txt, cfg["cross_attention_dim"]),
                  added_cond_kwargs={"text_embeds": randn(b, spec["text_embeds"]),
                                     "time_ids": ids.repeat(b, 1).to(device=device,
                                                                     dtype=dtype)})
    elif family == "vae":
        kw = dict(sample=randn(b, cfg["in_channels"], h, w))
    elif family == "wan":
        kw = dict(hidden_states=randn(b, cfg["in_channels"], spec["frames"], h, w),
                  timestep=full(500),
                  encoder_hidden_states=randn(b, n_txt, cfg["text_dim"]))
    else:
        raise KeyError(family)
    kw["return_dict"] = False
    return kw


def run_eager(model, inputs):
    """Run ``model(**inputs)`` under ``torch.no_grad()`` and return the first output tensor."""
    with torch.no_grad():
        out = model(**inputs)
    return out[0] if isinstance(out, (tuple, list)) else out


def describe(family, size):
    """One-line description: class, parameter count (built on the meta device) and resolutions."""
    import diffusers

    entry = _entry(family, size)
    with torch.device("meta"):
        n = sum(p.numel() for p in getattr(diffusers, entry["cls"])(**entry["config"]).parameters())
    res = ", ".join(f"{h}x{w}" for h, w in entry["inputs"]["resolutions"])
    return (f"{family}/{size}: {entry['cls']} {n / 1e6:.2f}M params, batch {entry['inputs']['batch']}, "
            f"latent {res} (default first), text_len {entry['inputs']['text_len']}")


def _median_ms(fn, warmup=1, runs=5):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    for fam, sz in MODEL_CONFIGS:
        print(describe(fam, sz))
        model = build_model(fam, sz)
        for res in MODEL_CONFIGS[(fam, sz)]["inputs"]["resolutions"]:
            inputs = make_inputs(fam, sz, resolution=res)
            out = run_eager(model, inputs)
            ms = _median_ms(lambda: run_eager(model, inputs))
            print(f"  {res[0]}x{res[1]}: out {tuple(out.shape)}  max|out| {out.abs().max().item():.4g}"
                  f"  {ms:.2f} ms/call")
