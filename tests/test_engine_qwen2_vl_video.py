"""Qwen2-VL and Qwen2.5-VL videos: the video processor's patches against transformers' image processor (a still
video) and its patch layout, the engine's greedy tokens and logprobs against transformers' for prompts holding a
video beside an image (frames attending within their temporal patch, M-RoPE's temporal index moving by the video's
time step), batched, from the prefix cache and through `LLM.chat` with a video file; what is refused, by name."""

from __future__ import annotations

import base64

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve.engine.image_prompt import ImagePrompt  # noqa: E402
from jaxserve.engine.multimodal import PreparedVideo  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402
from jaxserve.videos import Video, load_video  # noqa: E402
from jaxserve.videos_qwen2 import QwenVideoProcessor  # noqa: E402
from tests.llava_model import random_image  # noqa: E402
from tests.modelrun import (  # noqa: E402
    assert_batched_then_cached,
    assert_same_greedy,
    drain,
    image_engine,
    run_images,
    torch_greedy,
)
from tests.qwen2_vl_model import (  # noqa: E402
    IMAGE_TOKEN,
    PROCESSOR,
    VIDEO_TOKEN,
    VISION_END,
    VISION_START,
    saved_tiny_qwen,
)

NEW_TOKENS = 6
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
FIELDS = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}


def frames(seed: int, n: int, height: int, width: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, height, width, 3), dtype=np.uint8)


def text(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 280, n).tolist()


def part(token: int) -> list[int]:
    return [VISION_START, token, VISION_END]


# A 5-frame video of 40 x 24 pixels (3 temporal patches of 5 x 3 tokens: its last frame repeated) after an image,
# and a 4-frame one of 32 x 32 (2 of 4 x 4) alone. Their rates: 8 and 4 frames a second, Qwen2.5-VL's temporal
# positions 1 and 2 apart (its tiny config's 4 tokens a second, 2 frames a patch).
PROMPTS = [text(1, 4) + part(IMAGE_TOKEN) + text(2, 3) + part(VIDEO_TOKEN) + text(3, 4),
           part(VIDEO_TOKEN) + text(4, 5)]
MEDIA = [{"image": [random_image(1, (31, 50))], "video": [(frames(5, 5, 40, 24), {"fps": 8})]},
         {"video": [(frames(6, 4, 32, 32), {"fps": 4})]}]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "exaone4_5"])
def qwen(request, tmp_path_factory):
    return saved_tiny_qwen(tmp_path_factory.mktemp(request.param), request.param)


def video_processor() -> QwenVideoProcessor:
    return QwenVideoProcessor.from_dict(PROCESSOR)


def hf_greedy(model, ids: list[int], media: dict) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and logprobs for a prompt with an image and videos (each placeholder expanded),
    the videos' patches made by ours (checked against transformers' in the tests below)."""
    kw, counts = {}, {IMAGE_TOKEN: [], VIDEO_TOKEN: []}
    if media.get("image"):
        processed = transformers.Qwen2VLImageProcessorPil(**FIELDS)(media["image"], return_tensors="pt")
        kw.update(pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"])
        counts[IMAGE_TOKEN] = [t * h * w // 4 for t, h, w in processed["image_grid_thw"].tolist()]
    patches, grids, seconds = [], [], []
    for frames_, meta in media["video"]:
        p, grid = video_processor()(Video(frames_, meta["fps"], len(frames_)))
        patches.append(torch.from_numpy(p))
        grids.append(grid)
        seconds.append(2 / meta["fps"])
        counts[VIDEO_TOKEN].append(int(np.prod(grid)) // 4)
    kw.update(pixel_values_videos=torch.cat(patches), video_grid_thw=torch.tensor(grids),
              second_per_grid_ts=torch.tensor(seconds))
    its = {t: iter(c) for t, c in counts.items()}
    expanded = [x for i in ids for x in ([i] * next(its[i]) if i in its else [i])]

    def forward(ids: list[int]):
        ids_t = torch.tensor([ids])
        kinds = (ids_t == IMAGE_TOKEN).int() + 2 * (ids_t == VIDEO_TOKEN).int()
        return model(input_ids=ids_t, mm_token_type_ids=kinds, **kw).logits[0, -1]

    return torch_greedy(forward, expanded, NEW_TOKENS)


def test_a_still_video_makes_the_image_processors_patches_and_frames_are_laid_out_as_transformers_does():
    """Two frames of one image: transformers' image processor's patches (the image repeated in time). Five frames:
    the last repeated to a whole temporal patch, the patches laid out as transformers' `patchify` lays them out
    (temporal patch, merge group row by row, patch; values over channel, frame, row, column)."""
    image = random_image(3, (45, 70))
    still = np.stack([np.asarray(image)] * 2)
    want = transformers.Qwen2VLImageProcessorPil(**FIELDS)(image, return_tensors="np")
    got, grid = video_processor()(Video(still, None, 2))
    assert [list(grid)] == want["image_grid_thw"].tolist()
    np.testing.assert_allclose(got, want["pixel_values"], atol=1e-6)

    video = frames(7, 5, 24, 16)  # within the pixel bounds: not resized
    got, grid = video_processor()(Video(video, None, 5))
    mean = np.asarray([0.48145466, 0.4578275, 0.40821073], np.float32)  # (CLIP's: the processor's defaults)
    std = np.asarray([0.26862954, 0.26130258, 0.27577711], np.float32)
    pixels = torch.from_numpy(((video / 255.0).astype(np.float32) - mean) / std).permute(0, 3, 1, 2)[None]
    pixels = torch.cat([pixels, pixels[:, -1:]], dim=1)  # [1, 6, C, H, W]
    t, h, w = 3, 6, 4
    ref = pixels.view(1, t, 2, 3, h // 2, 2, 4, w // 2, 2, 4).permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    assert grid == (t, h, w)
    np.testing.assert_allclose(got, ref.reshape(t * h * w, 3 * 2 * 4 * 4).numpy(), atol=1e-5)


def test_qwen2_vl_video_engine_equals_transformers(qwen):
    """An image and a video in one prompt, a video alone in another, in one batch across 32-token chunks; then each
    alone, the second time from the prefix cache."""
    path, model = qwen
    expected = [hf_greedy(model, p, m) for p, m in zip(PROMPTS, MEDIA, strict=True)]
    eng = image_engine(path)
    videos = [eng.images.prepare_video(m["video"][0]) for m in MEDIA]
    assert [v.grid for v in videos] == [(3, 10, 6), (2, 8, 8)]
    assert [eng.images.num_tokens(v) for v in videos] == [45, 32]
    steps = [1.0, 2.0] if "tokens_per_second" in model.config.vision_config.to_dict() else [1.0, 1.0]
    assert [v.time_step for v in videos] == steps
    assert_batched_then_cached(eng, PROMPTS, MEDIA, expected, 40 + 32, params=GREEDY)


@pytest.mark.parametrize("qwen", ["qwen2_5_vl"], indirect=True)
def test_the_time_step_makes_the_difference(qwen):
    """Qwen2.5-VL: the same frames at another rate turn by other temporal positions (and are another video to the
    prefix cache): transformers' logprobs at that rate, not at the first."""
    path, model = qwen
    slow = {"video": [(MEDIA[1]["video"][0][0], {"fps": 8})]}
    want_fast, want_slow = hf_greedy(model, PROMPTS[1], MEDIA[1]), hf_greedy(model, PROMPTS[1], slow)
    assert np.max(np.abs(np.asarray(want_fast[1]) - np.asarray(want_slow[1]))) > 1e-3
    eng = image_engine(path)
    assert_same_greedy(run_images(eng, PROMPTS[1:] * 2, [MEDIA[1], slow], params=GREEDY), [want_fast, want_slow])


def test_the_text_after_a_long_video_goes_on_from_its_largest_position():
    """A video whose temporal positions outrun its rows and columns (5 patches 2 apart, 2 x 2 tokens each): its
    tokens turn by (2 * patch, row, column) from its first position; the text after it from one past the largest
    (8), as the original Qwen code and vLLM place it; an image's by its longest side."""
    prompt = ImagePrompt([(3, 20), (25, 4)], [-1, -2], grids=[(5, 2, 2), (1, 2, 2)], time_steps=[2.0, 1.0])
    out = np.zeros((3, 32), np.int32)
    prompt.rope_offsets(0, 32, out)
    positions = out + np.arange(32)
    k = np.arange(20)
    np.testing.assert_array_equal(positions[:, 3:23], 3 + np.stack([k // 4 * 2, k // 2 % 2, k % 2]))
    np.testing.assert_array_equal(positions[:, 23:25], [[12, 13]] * 3)  # 3 + 8 + 1
    np.testing.assert_array_equal(positions[:, 25:29], 14 + np.array([[0, 0, 0, 0], [0, 0, 1, 1], [0, 1, 0, 1]]))
    np.testing.assert_array_equal(positions[:, 29:], [[16, 17, 18]] * 3)
    assert prompt.rope_delta == int(out[0, -1])


def mjpeg_video(tmp_path, clip: np.ndarray, fps: float) -> str:
    """A video file (Motion JPEG in AVI) of the clip's frames, as a data URL."""
    cv2 = pytest.importorskip("cv2")
    file = str(tmp_path / "clip.avi")
    writer = cv2.VideoWriter(file, cv2.VideoWriter_fourcc(*"MJPG"), fps, clip.shape[2:0:-1])
    for frame in clip:
        writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    writer.release()
    with open(file, "rb") as f:
        return "data:video/x-msvideo;base64," + base64.b64encode(f.read()).decode()


@pytest.mark.parametrize("qwen", ["qwen2_vl"], indirect=True)
def test_chat_with_a_video_file(qwen, tmp_path):
    """`LLM.chat` with a `video_url` part naming a video file: decoded, sampled at the processor's 2 frames a second
    (10 frames at 5 a second: 4, evenly spaced), the template's `<|video_pad|>` filled with its tokens; the reply is
    the engine's for those frames."""
    from jaxserve.llm import LLM

    path, _ = qwen
    clip = np.repeat(np.repeat(frames(8, 10, 4, 3), 8, axis=1), 8, axis=2)  # smooth: JPEG keeps it within a few
    url = mjpeg_video(tmp_path, clip, 5.0)
    video = load_video(url, None, video_processor().sampler)
    assert (video.total_frames, video.fps, len(video.frames)) == (10, 5.0, 4)
    assert np.abs(video.frames.astype(int) - clip[[0, 2, 5, 7]]).mean() < 4
    llm = LLM(model=path, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=512, page_size=8,
              kv_cache_memory_bytes=2**21, dtype="float32", warmup=False, compile_cache_dir=None)
    message = {"role": "user", "content": [{"type": "text", "text": "t5"},
                                           {"type": "video_url", "video_url": {"url": url}}]}
    reply = llm.chat([message], GREEDY)[0]
    words = "user : t5 <|vision_start|> <|video_pad|> <|vision_end|> <eos> assistant :".split()
    ids = [llm.engine.tokenizer.encode(w, add_special_tokens=False)[0] for w in words]
    assert reply.prompt_token_ids == ids[:4] + [VIDEO_TOKEN] * 2 * 4 * 3 + ids[5:]
    want = run_images(image_engine(path), [ids], [{"video": [(video.frames, {"fps": video.sampled_fps})]}],
                      params=GREEDY)[0][0]
    assert list(reply.outputs[0].token_ids) == want
    # Over HTTP: the same prompt (its usage) and reply.
    import httpx

    from jaxserve.engine.async_engine import AsyncEngine
    from server.config import ServerConfig
    from server.runner import serve_in_thread

    engine = AsyncEngine(llm.engine)
    server = serve_in_thread(engine, ServerConfig(port=0))
    try:
        body = {"messages": [message], "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(reply.prompt_token_ids)
        assert r.json()["choices"][0]["message"]["content"] == reply.outputs[0].text
        bad = {**body, "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}]}
        r = httpx.post(server.url + "/v1/chat/completions", json=bad, timeout=120)
        assert r.status_code == 400 and "not a video OpenCV can read" in r.json()["error"]["message"]
    finally:
        server.stop()
        engine.shutdown()


@pytest.mark.parametrize("qwen", ["qwen2_5_vl"], indirect=True)
def test_what_videos_are_refused(qwen):
    path, _ = qwen
    eng = image_engine(path, limit_mm_per_prompt={"video": 1})
    clip = (frames(9, 2, 16, 16), {"fps": 2})
    for prompt, media, message in [
        (PROMPTS[1], {"video": [clip, clip]}, "2 videos exceed the limit of 1"),
        (text(5, 4), {"video": clip}, r"video placeholders \(0 of token"),
        (PROMPTS[1], {"video": np.zeros((2, 16, 16, 3), np.float32)}, "must be uint8"),
        (PROMPTS[1], {"video": np.zeros((16, 16), np.uint8)}, r"must be an array \[frames, height, width, 3\]"),
        (PROMPTS[1], {"video": (clip[0], {"fps": -1})}, "fps must be a number > 0"),
        (PROMPTS[1], {"video": "data:video/mp4;base64,AAAA"}, "not a video OpenCV can read"),
        (PROMPTS[1], {"video": "/etc/passwd"}, "local files are read only under"),
        (PROMPTS[1], {"audio": [1]}, "images and videos only"),
    ]:
        with pytest.raises(ValueError, match=message):
            eng.add_request("x", prompt, GREEDY, multi_modal_data=media)
    eng.check_integrity()
    assert not eng.has_unfinished_requests()


def test_a_video_crosses_to_a_follower_whole():
    """A prepared video in the lock-step message (`sharding.distributed`) comes back with its grid and time step."""
    from sharding.distributed import _image_from_message, _image_message

    video = PreparedVideo(np.arange(24, dtype=np.float32).reshape(2, 12), (16, 8), b"\x01" * 40, (2, 1, 1), 0.5)
    back = _image_from_message(_image_message(video))
    assert isinstance(back, PreparedVideo)
    assert (back.size, back.digest, back.grid, back.time_step) == ((16, 8), video.digest, (2, 1, 1), 0.5)
    np.testing.assert_array_equal(back.pixels, video.pixels)


QWEN3_VIDEO = {"video_processor_type": "Qwen3VLVideoProcessor", "size": {"shortest_edge": 1024, "longest_edge": 8192},
               "patch_size": 4, "temporal_patch_size": 2, "merge_size": 2}


@pytest.mark.parametrize("qwen", ["qwen3_vl", "qwen3_5"], indirect=True)
def test_qwen3_vl_video_engine_equals_transformers(qwen):
    """Qwen3-VL (and Qwen3.5, whose videos are Qwen3-VL's): given frames sampled evenly (9 at 6 a second: 4, frames 0, 3, 5 and 8), each temporal patch written
    after its time as transformers' processor writes it, and its tokens turned as an image's; the greedy tokens and
    logprobs of a prompt with a video and an image are transformers' on that prompt, again from the prefix cache."""
    import json
    import types

    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    path, model = qwen
    with open(f"{path}/video_preprocessor_config.json", "w") as f:
        json.dump(QWEN3_VIDEO, f)
    clip = frames(10, 9, 32, 24)
    media = {"image": [random_image(2, (40, 40))], "video": [(clip, {"fps": 6})]}
    prompt = text(1, 3) + part(VIDEO_TOKEN) + text(2, 3) + part(IMAGE_TOKEN) + text(3, 2)
    eng = image_engine(path)
    video = eng.images.prepare_video(media["video"][0])
    assert video.grid == (2, 8, 6)
    processor = types.SimpleNamespace(video_processor=types.SimpleNamespace(merge_size=2, temporal_patch_size=2),
                                      vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>",
                                      video_token="<|video_pad|>")
    processor._calculate_timestamps = types.MethodType(Qwen3VLProcessor._calculate_timestamps, processor)
    want_times = processor._calculate_timestamps([0, 3, 5, 8], 6, 2)
    assert video.timestamps == pytest.approx(want_times) and len(want_times) == 2
    written = Qwen3VLProcessor.replace_video_token(processor, {
        "video_grid_thw": torch.tensor([video.grid]), "video_metadata": [types.SimpleNamespace(
            fps=6, frames_indices=[0, 3, 5, 8])]}, 0)
    processed = transformers.Qwen2VLImageProcessorPil(**FIELDS)(media["image"], return_tensors="pt")
    image = [IMAGE_TOKEN] * (int(processed["image_grid_thw"].prod()) // 4)
    ids = prompt[:3] + eng.tokenizer.encode(written) + prompt[6:10] + image + prompt[11:]

    got = run_images(eng, [prompt], [media], params=GREEDY)
    pixels, _ = QwenVideoProcessor.from_dict(QWEN3_VIDEO)(Video(clip[[0, 3, 5, 8]], 6.0, 9))
    kw = dict(pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"],
              pixel_values_videos=torch.from_numpy(pixels), video_grid_thw=torch.tensor([video.grid]))

    def forward(ids: list[int]):
        ids_t = torch.tensor([ids])
        kinds = (ids_t == IMAGE_TOKEN).int() + 2 * (ids_t == VIDEO_TOKEN).int()
        return model(input_ids=ids_t, mm_token_type_ids=kinds, **kw).logits[0, -1]

    expected = torch_greedy(forward, ids, NEW_TOKENS)
    assert_same_greedy(got, [expected])
    hits = eng.scheduler.cache.hit_tokens
    assert_same_greedy(run_images(eng, [prompt], [media], ["again"], params=GREEDY), [expected])
    assert eng.scheduler.cache.hit_tokens - hits >= 40
    eng.add_request("ids", prompt, GREEDY, multi_modal_data=media)
    assert drain(eng)["ids"].prompt_token_ids == ids
    # Encoded ahead (a server's thread, as the video arrives), the video's two patches a prompt looks up are in the
    # cache (the image, not encoded ahead, is not).
    assert eng.reset_prefix_cache()
    eng.images.clear_cache()
    eng.images.encode_ahead(video)
    queries, found = eng.images.cache_queries, eng.images.cache_hits
    assert_same_greedy(run_images(eng, [prompt], [media], ["ahead"], params=GREEDY), [expected])
    assert (eng.images.cache_queries - queries, eng.images.cache_hits - found) == (3, 2)
    eng.check_integrity()


def test_qwen3_vl_video_prompt_layout():
    """Each temporal patch after its time; the template's start and end around the one placeholder become the first
    patch's start and the last's end; a bare placeholder gets both; a prompt written so before is kept."""
    from jaxserve.engine.video_qwen3 import frames_of, timestamped

    video = PreparedVideo(np.zeros((2 * 4, 3), np.float32), (8, 8), b"v" * 32, (2, 2, 2), 1.0, (0.25, 1.5))
    times = lambda at: [100 + int(at * 10)]  # noqa: E731
    S, E, P = VISION_START, VISION_END, VIDEO_TOKEN
    want = [7, 102, S, P, E, 115, S, P, E, 8]
    assert timestamped([7, S, P, E, 8], [video], [1], times, S, E, P) == want
    assert timestamped([7, P, 8], [video], [1], times, S, E, P) == want
    assert timestamped(want, [video], [1], times, S, E, P) == want
    parts = frames_of(video)
    assert [p.grid for p in parts] == [(1, 2, 2)] * 2 and len({p.digest for p in parts}) == 2
    np.testing.assert_array_equal(np.concatenate([p.pixels for p in parts]), video.pixels)


@pytest.mark.parametrize("qwen", ["qwen2_vl"], indirect=True)
def test_media_io_kwargs_set_a_files_frames(qwen, tmp_path):
    """vLLM's `--media-io-kwargs '{"video": {"num_frames": n}}'`: a video file sampled to n frames evenly, first and
    last included (-1: every frame), before the model's processor; refusals by name."""
    from jaxserve.engine_args import EngineArgs
    from jaxserve.videos import read_video

    path, _ = qwen
    clip = np.repeat(np.repeat(frames(8, 10, 4, 3), 8, axis=1), 8, axis=2)
    url = mjpeg_video(tmp_path, clip, 5.0)
    got = read_video(video_processor(), url, None, 6)
    assert (got.frame_indices.tolist(), got.sampled_fps) == ([0, 1, 3, 5, 7, 9], 3.0)
    assert len(read_video(video_processor(), url, None, -1).frames) == 10
    eng = image_engine(path, media_io_kwargs='{"video": {"num_frames": 6}}')
    assert eng.images.prepare_video(url).grid == (3, 8, 6)
    for bad, message in [('{"audio": {}}', "audio"), ('{"video": {"num_frames": 0}}', "num_frames must be"),
                         ('{"video": {"fps": 2}}', "fps")]:
        with pytest.raises(ValueError, match=message):
            EngineArgs(model=path, media_io_kwargs=bad)
