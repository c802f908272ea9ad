"""Tiny configs of diffusers model classes beyond ``fxbackend.models``' table, for the
correctness sweep of tests/test_model_zoo.py: image and video transformers (Sana, AuraFlow,
LTX-Video, CogVideoX, HunyuanDiT, HiDream, Qwen-Image, Chroma, Lumina 2, CogView4, Mochi,
HunyuanVideo, Stable Audio), the VAEs (SD's encode and decode, Wan's decode), UNets
(UNet2DModel, Kandinsky 2.1 / 2.2), ControlNets (SD, SD3, Flux), UVit2D and the prior.

``ZOO[name]``: ``cls`` (the diffusers class), ``config`` (constructor kwargs: the real
architecture, scaled down), ``inputs`` (``fn(randn, full) -> forward kwargs``) and optionally
``call`` ("encode" / "decode": a VAE wrapped to return tensors).  :func:`build` gives the
module (random weights as ``fxbackend.models`` draws them) and its kwargs in a dtype.
"""
import torch

from fxbackend.models import _rerandomize

IMG = 16  # latent side for image models


def _flux_ids(h, w, n_txt):
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] += torch.arange(h // 2)[:, None]
    ids[..., 2] += torch.arange(w // 2)[None, :]
    return ids.reshape(-1, 3).clone(), torch.zeros(n_txt, 3)


def _hunyuandit_rope(head_dim, gh, gw):
    from diffusers.models.embeddings import get_2d_rotary_pos_embed
    crops = ((0, 0), (gh, gw))  # pipeline's get_resize_crop_region_for_grid at base size = grid
    return get_2d_rotary_pos_embed(head_dim, crops, (gh, gw), output_type="pt")


def _stable_audio_rope(head_dim, n):
    from diffusers.models.embeddings import get_1d_rotary_pos_embed
    return get_1d_rotary_pos_embed(head_dim // 2, n, use_real=True, repeat_interleave_real=False)


def _inputs_sana(r, f):
    return dict(hidden_states=r(1, 4, IMG, IMG), encoder_hidden_states=r(1, 7, 32), timestep=f(500))


def _inputs_auraflow(r, f):
    return dict(hidden_states=r(1, 4, IMG, IMG), encoder_hidden_states=r(1, 7, 32), timestep=f(0.5))


def _inputs_ltx(r, f):
    F_, H, W = 2, 8, 8
    return dict(hidden_states=r(1, F_ * H * W, 8), encoder_hidden_states=r(1, 7, 16),
                timestep=torch.full((1,), 500, dtype=torch.long),
                encoder_attention_mask=torch.ones(1, 7, dtype=torch.long),
                num_frames=F_, height=H, width=W)


def _inputs_cogvideox(r, f):
    return dict(hidden_states=r(1, 2, 4, 8, 8), encoder_hidden_states=r(1, 8, 16),
                timestep=torch.full((1,), 500, dtype=torch.long))


def _inputs_hunyuandit(r, f):
    cos, sin = _hunyuandit_rope(8, 4, 4)  # head dim 8, 8x8 latent / patch 2
    return dict(hidden_states=r(1, 4, 8, 8), timestep=f(500), encoder_hidden_states=r(1, 7, 32),
                text_embedding_mask=torch.ones(1, 7, dtype=torch.long),
                encoder_hidden_states_t5=r(1, 7, 32),
                text_embedding_mask_t5=torch.ones(1, 7, dtype=torch.long),
                image_meta_size=torch.tensor([[64.0, 64.0, 64.0, 64.0, 0.0, 0.0]]),
                style=torch.zeros(1, dtype=torch.long), image_rotary_emb=(cos, sin))


def _inputs_hidream(r, f):
    return dict(hidden_states=r(1, 4, IMG, IMG), timesteps=torch.full((1,), 500, dtype=torch.long),
                encoder_hidden_states_t5=r(1, 7, 8), encoder_hidden_states_llama3=r(2, 1, 7, 4),
                pooled_embeds=r(1, 8))


def _inputs_qwen(r, f):
    h = w = IMG
    return dict(hidden_states=r(1, (h // 2) * (w // 2), 16), encoder_hidden_states=r(1, 7, 16),
                encoder_hidden_states_mask=torch.ones(1, 7, dtype=torch.long),
                timestep=f(0.5), img_shapes=[(1, h // 2, w // 2)])


def _inputs_chroma(r, f):
    img_ids, txt_ids = _flux_ids(IMG, IMG, 7)
    return dict(hidden_states=r(1, (IMG // 2) ** 2, 16), encoder_hidden_states=r(1, 7, 32),
                timestep=f(0.5), img_ids=img_ids, txt_ids=txt_ids)


def _inputs_lumina2(r, f):
    return dict(hidden_states=r(1, 4, IMG, IMG), timestep=f(0.5), encoder_hidden_states=r(1, 7, 8),
                encoder_attention_mask=torch.ones(1, 7, dtype=torch.bool))


def _inputs_cogview4(r, f):
    return dict(hidden_states=r(1, 4, IMG, IMG), encoder_hidden_states=r(1, 8, 8),
                timestep=torch.full((1,), 500, dtype=torch.long),
                original_size=torch.tensor([[128.0, 128.0]]),
                target_size=torch.tensor([[128.0, 128.0]]),
                crop_coords=torch.tensor([[0.0, 0.0]]))


def _inputs_mochi(r, f):
    return dict(hidden_states=r(1, 4, 2, IMG, IMG), encoder_hidden_states=r(1, 7, 16),
                timestep=torch.full((1,), 500, dtype=torch.long),
                encoder_attention_mask=torch.ones(1, 7, dtype=torch.bool))


def _inputs_hunyuanvideo(r, f):
    return dict(hidden_states=r(1, 4, 1, IMG, IMG),
                timestep=torch.full((1,), 500, dtype=torch.long),
                encoder_hidden_states=r(1, 12, 16),
                encoder_attention_mask=torch.ones(1, 12, dtype=torch.long),
                pooled_projections=r(1, 8), guidance=f(3500))


def _inputs_stable_audio(r, f):
    cos, sin = _stable_audio_rope(4, 16 + 1)
    return dict(hidden_states=r(1, 4, 16), timestep=f(500), encoder_hidden_states=r(1, 5, 4),
                global_hidden_states=r(1, 1, 8), rotary_embedding=(cos, sin))


def _inputs_unet2d(r, f):
    return dict(sample=r(1, 3, IMG, IMG), timestep=f(500))


def _inputs_controlnet(r, f):
    return dict(sample=r(1, 4, IMG, IMG), timestep=f(500), encoder_hidden_states=r(1, 7, 32),
                controlnet_cond=r(1, 3, 2 * IMG, 2 * IMG))


def _inputs_sd3_controlnet(r, f):
    return dict(hidden_states=r(1, 4, IMG, IMG), controlnet_cond=r(1, 4, IMG, IMG),
                encoder_hidden_states=r(1, 7, 32), pooled_projections=r(1, 64), timestep=f(500))


def _inputs_flux_controlnet(r, f):
    img_ids, txt_ids = _flux_ids(IMG, IMG, 7)
    return dict(hidden_states=r(1, (IMG // 2) ** 2, 16), controlnet_cond=r(1, (IMG // 2) ** 2, 16),
                encoder_hidden_states=r(1, 7, 32), pooled_projections=r(1, 32), timestep=f(0.5),
                img_ids=img_ids, txt_ids=txt_ids, guidance=f(4.0))


def _inputs_uvit(r, f):
    g = torch.Generator().manual_seed(1)
    return dict(input_ids=torch.randint(0, 32, (1, 8, 8), generator=g),
                encoder_hidden_states=r(1, 7, 32),
                pooled_text_emb=r(1, 32), micro_conds=torch.tensor([[512.0, 512.0, 0.0, 0.0, 6.0]]))


def _inputs_prior(r, f):
    return dict(hidden_states=r(1, 8), timestep=torch.full((1,), 500, dtype=torch.long),
                proj_embedding=r(1, 8), encoder_hidden_states=r(1, 7, 8),
                attention_mask=torch.ones(1, 7, dtype=torch.bool))


def _inputs_kandinsky22(r, f):
    return dict(sample=r(1, 4, IMG, IMG), timestep=f(500), encoder_hidden_states=None,
                added_cond_kwargs={"image_embeds": r(1, 32)})


def _inputs_kandinsky21(r, f):
    return dict(sample=r(1, 4, IMG, IMG), timestep=f(500), encoder_hidden_states=r(1, 7, 32),
                added_cond_kwargs={"text_embeds": r(1, 32), "image_embeds": r(1, 32)})


def _inputs_vae_enc(r, f):
    return dict(x=r(1, 3, 32, 32))


def _inputs_vae_dec(r, f):
    return dict(z=r(1, 4, 8, 8))


def _inputs_wanvae_dec(r, f):
    return dict(z=r(1, 4, 2, 8, 8))


VAE_CFG = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
               up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16),
               layers_per_block=1, latent_channels=4, norm_num_groups=4, sample_size=32)

def _kandinsky_unet(addition_embed_type, encoder_hid_dim_type):
    """Kandinsky 2.x's UNet (2.2: image embeddings; 2.1: text and image)."""
    return dict(
        sample_size=IMG, in_channels=4, out_channels=8, addition_embed_type=addition_embed_type,
        down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
        up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
        mid_block_type="UNetMidBlock2DSimpleCrossAttn", block_out_channels=(16, 32),
        layers_per_block=1, encoder_hid_dim=32, encoder_hid_dim_type=encoder_hid_dim_type,
        cross_attention_dim=32, attention_head_dim=4, resnet_time_scale_shift="scale_shift",
        class_embed_type=None, norm_num_groups=8)


ZOO = {
    "sana": dict(cls="SanaTransformer2DModel", inputs=_inputs_sana, config=dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
        num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16,
        caption_channels=32, sample_size=32, patch_size=1)),
    "auraflow": dict(cls="AuraFlowTransformer2DModel", inputs=_inputs_auraflow, config=dict(
        sample_size=32, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1,
        attention_head_dim=8, num_attention_heads=4, joint_attention_dim=32,
        caption_projection_dim=32, out_channels=4, pos_embed_max_size=256)),
    "ltxvideo": dict(cls="LTXVideoTransformer3DModel", inputs=_inputs_ltx, config=dict(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2,
        attention_head_dim=8, cross_attention_dim=16, num_layers=2, caption_channels=16,
        qk_norm="rms_norm_across_heads")),
    "cogvideox": dict(cls="CogVideoXTransformer3DModel", inputs=_inputs_cogvideox, config=dict(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        time_embed_dim=4, text_embed_dim=16, num_layers=2, sample_width=8, sample_height=8,
        sample_frames=5, patch_size=2, temporal_compression_ratio=4, max_text_seq_length=8)),
    "hunyuandit": dict(cls="HunyuanDiT2DModel", inputs=_inputs_hunyuandit, config=dict(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, patch_size=2, sample_size=8,
        hidden_size=16, num_layers=2, mlp_ratio=4.0, learn_sigma=True, cross_attention_dim=32,
        cross_attention_dim_t5=32, pooled_projection_dim=16, text_len=7, text_len_t5=7)),
    # the Llama 3 states are [layers, batch, tokens, features]
    "hidream": dict(cls="HiDreamImageTransformer2DModel", inputs=_inputs_hidream,
                    batch_dims={"encoder_hidden_states_llama3": 1}, config=dict(
        patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1,
        attention_head_dim=8, num_attention_heads=4, caption_channels=[8, 4], text_emb_dim=8,
        num_routed_experts=4, num_activated_experts=2, axes_dims_rope=(4, 2, 2),
        max_resolution=(32, 32), llama_layers=(0, 1))),
    "qwenimage": dict(cls="QwenImageTransformer2DModel", inputs=_inputs_qwen, config=dict(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=3, joint_attention_dim=16, guidance_embeds=False,
        axes_dims_rope=(8, 4, 4))),
    "chroma": dict(cls="ChromaTransformer2DModel", inputs=_inputs_chroma, config=dict(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
        approximator_num_channels=8, approximator_hidden_dim=32, approximator_layers=1)),
    "lumina2": dict(cls="Lumina2Transformer2DModel", inputs=_inputs_lumina2, config=dict(
        sample_size=16, patch_size=2, in_channels=4, hidden_size=24, num_layers=2,
        num_refiner_layers=1, num_attention_heads=3, num_kv_heads=1, multiple_of=16,
        axes_dim_rope=(4, 2, 2), axes_lens=(128, 128, 128), cap_feat_dim=8)),
    "cogview4": dict(cls="CogView4Transformer2DModel", inputs=_inputs_cogview4, config=dict(
        patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=4,
        num_attention_heads=4, text_embed_dim=8, time_embed_dim=8, condition_dim=4)),
    "mochi": dict(cls="MochiTransformer3DModel", inputs=_inputs_mochi, config=dict(
        patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=2,
        pooled_projection_dim=16, in_channels=4, text_embed_dim=16, time_embed_dim=4,
        max_sequence_length=16)),
    "hunyuanvideo": dict(cls="HunyuanVideoTransformer3DModel", inputs=_inputs_hunyuanvideo,
                         config=dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1,
        guidance_embeds=True, text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4))),
    "stableaudio": dict(cls="StableAudioDiTModel", inputs=_inputs_stable_audio, config=dict(
        sample_size=16, in_channels=4, num_layers=2, attention_head_dim=4, num_attention_heads=2,
        num_key_value_attention_heads=2, out_channels=4, cross_attention_dim=4, time_proj_dim=8,
        global_states_input_dim=8, cross_attention_input_dim=4)),
    "vae_encode": dict(cls="AutoencoderKL", inputs=_inputs_vae_enc, call="encode", config=VAE_CFG),
    "vae_decode": dict(cls="AutoencoderKL", inputs=_inputs_vae_dec, call="decode", config=VAE_CFG),
    "wanvae_decode": dict(cls="AutoencoderKLWan", inputs=_inputs_wanvae_dec, call="decode",
                          config=dict(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4)),
    "unet2d": dict(cls="UNet2DModel", inputs=_inputs_unet2d, config=dict(
        sample_size=IMG, in_channels=3, out_channels=3, block_out_channels=(16, 32),
        layers_per_block=1, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8, attention_head_dim=8)),
    "controlnet": dict(cls="ControlNetModel", inputs=_inputs_controlnet, config=dict(
        in_channels=4, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        cross_attention_dim=32, attention_head_dim=2, norm_num_groups=8,
        conditioning_embedding_out_channels=(8, 16))),
    "sd3_controlnet": dict(cls="SD3ControlNetModel", inputs=_inputs_sd3_controlnet, config=dict(
        sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32,
        pooled_projection_dim=64, out_channels=4, pos_embed_max_size=32)),
    "flux_controlnet": dict(cls="FluxControlNetModel", inputs=_inputs_flux_controlnet, config=dict(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        guidance_embeds=True, axes_dims_rope=(4, 6, 6))),
    "uvit2d": dict(cls="UVit2DModel", inputs=_inputs_uvit, config=dict(
        hidden_size=32, use_bias=False, cond_embed_dim=32, micro_cond_encode_dim=2,
        micro_cond_embed_dim=10, encoder_hidden_size=32, vocab_size=32, codebook_size=32,
        in_channels=16, block_out_channels=32, num_res_blocks=1, downsample=True, upsample=True,
        block_num_heads=1, num_hidden_layers=1, num_attention_heads=1, intermediate_size=32,
        sample_size=8)),
    "prior": dict(cls="PriorTransformer", inputs=_inputs_prior, config=dict(
        num_attention_heads=2, attention_head_dim=4, num_layers=2, embedding_dim=8,
        num_embeddings=7, additional_embeddings=4)),
    "kandinsky22_unet": dict(cls="UNet2DConditionModel", inputs=_inputs_kandinsky22,
                             config=_kandinsky_unet("image", "image_proj")),
    "kandinsky21_unet": dict(cls="UNet2DConditionModel", inputs=_inputs_kandinsky21,
                             config=_kandinsky_unet("text_image", "text_image_proj")),
}


class VAEEncode(torch.nn.Module):
    """``vae.encode(x)``'s latent mean and std."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, x):
        d = self.vae.encode(x).latent_dist
        return d.mean, d.std


class VAEDecode(torch.nn.Module):
    """``vae.decode(z).sample``."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, z):
        return self.vae.decode(z).sample


def _cast(x, dtype):
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, dict):
        return {k: _cast(v, dtype) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(v, dtype) for v in x)
    return x


def _batched(v, batch, dims=None, dim=0):
    """``v`` with every tensor whose batch dim (``dim``; ``dims[key]`` for the input ``key``) is
    1 made ``batch`` long: the first row as it was, the others its values scaled by 0.9 per
    row (timesteps stay in range, latents and embeddings differ per row); integer tensors
    repeated."""
    if isinstance(v, dict):
        return {k: _batched(x, batch, dim=(dims or {}).get(k, 0)) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_batched(x, batch, dim=dim) for x in v)
    if isinstance(v, torch.Tensor) and v.dim() > dim and v.shape[dim] == 1 and batch != 1:
        if not v.is_floating_point():
            return v.repeat_interleave(batch, dim)
        return torch.cat([v * 0.9 ** i for i in range(batch)], dim)
    return v


def build(name, dtype=torch.float32, seed=0, batch=1):
    """``(module, kwargs)`` of ``ZOO[name]`` in ``dtype`` (floating inputs cast), eval mode;
    ``batch`` rows of inputs (``_batched``)."""
    import diffusers
    e = ZOO[name]
    torch.manual_seed(seed)
    model = getattr(diffusers, e["cls"])(**e["config"])
    _rerandomize(model, seed)
    model = torch.nn.Module.to(model, dtype=dtype).eval()
    if e.get("call") == "encode":
        model = VAEEncode(model).eval()
    elif e.get("call") == "decode":
        model = VAEDecode(model).eval()
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen)

    def full(v):
        return torch.full((1,), float(v))

    kw = e["inputs"](randn, full)
    if e.get("call") is None and name not in ("uvit2d",):
        kw["return_dict"] = False
    return model, _cast(_batched(kw, batch, e.get("batch_dims")), dtype)
