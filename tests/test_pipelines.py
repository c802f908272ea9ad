"""Whole diffusers pipelines as users run them: prompt embeddings passed in (no tokenizer, no
text encoder, nothing downloaded), the denoiser and the VAE decode compiled with fxbackend,
several denoising steps with classifier-free guidance at two resolutions, against the same
pipeline run eagerly; a second pass over both resolutions recompiles nothing."""
from __future__ import annotations

import pytest
import torch

import fxbackend
from fxbackend import models


def _sd_pipeline():
    import diffusers
    unet = models.build_model("unet", "tiny")
    vae = models.build_model("vae", "tiny")
    scheduler = diffusers.EulerDiscreteScheduler(num_train_timesteps=1000)
    return diffusers.StableDiffusionPipeline(
        vae=vae, text_encoder=None, tokenizer=None, unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)


def _run(pipe, size, embeds):
    cond, uncond = embeds
    return pipe(prompt_embeds=cond, negative_prompt_embeds=uncond, height=size, width=size,
                num_inference_steps=3, guidance_scale=5.0, output_type="pt",
                generator=torch.Generator().manual_seed(size)).images


@pytest.mark.usefixtures("no_grad")
def test_stable_diffusion_pipeline_two_resolutions_no_recompiles():
    pipe = _sd_pipeline()
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(0)
    dim = pipe.unet.config.cross_attention_dim
    embeds = (torch.randn(1, 7, dim, generator=g), torch.randn(1, 7, dim, generator=g))
    sizes = (32, 40)  # pixels: latents of 16x16 and 20x20 (the VAE halves once)
    eager = {s: _run(pipe, s, embeds) for s in sizes}
    torch._dynamo.reset()
    fxbackend.reset_stats()
    pipe.unet = torch.compile(pipe.unet, backend="fxbackend")
    pipe.vae.decode = torch.compile(pipe.vae.decode, backend="fxbackend")
    for s in sizes:
        out = _run(pipe, s, embeds)
        assert out.shape == eager[s].shape
        torch.testing.assert_close(out, eager[s], rtol=1e-4, atol=1e-4)
    compiled = fxbackend.stats()["graphs_compiled"]
    assert compiled >= 2 and fxbackend.stats()["fallback_graphs"] == 0
    with torch._dynamo.config.patch(error_on_recompile=True):
        for s in sizes:  # the second pass: every graph and plan is reused
            torch.testing.assert_close(_run(pipe, s, embeds), eager[s], rtol=1e-4, atol=1e-4)
    assert fxbackend.stats()["graphs_compiled"] == compiled
