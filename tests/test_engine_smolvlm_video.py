"""SmolVLM2's videos (`videos_idefics3`, `multimodal_idefics3`) against transformers: frames sampled as its
`sample_frames`, a video's text as its processor's `replace_video_token` writes it (introduction, each frame's time,
the frames as one-tile images), the number words, and greedy tokens and logprobs of a prompt with an image and a video
through the engine, batched and from the prefix cache, and of a video file through `LLM.chat`."""

from __future__ import annotations

import json
import os
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve.videos import Video  # noqa: E402
from jaxserve.videos_idefics3 import SmolVLMVideoProcessor, number_words, video_intro  # noqa: E402
from tests.llava_model import random_image, randomize  # noqa: E402
from tests.modelrun import assert_batched_then_cached, drain, image_engine, torch_greedy  # noqa: E402
from tests.qwen2_vl_model import save_word_tokenizer  # noqa: E402
from tests.test_engine_idefics3 import (  # noqa: E402
    FAKE,
    GLOBAL,
    GREEDY,
    IMAGE,
    MARKS,
    NEW_TOKENS,
    PROCESSOR,
    TEXT,
    VISION,
    hf_expanded,
    text,
)

# Words of the videos' text the tokenizer knows (the rest read as unknown, alike on both sides).
WORDS = {"three": 296, "four": 297, "0:00:02": 298, "Frame": 299}
VIDEO_SAMPLING = {"fps": 2, "max_frames": 4, "video_size": {"longest_edge": 48}}


@pytest.fixture(scope="module")
def smolvlm2(tmp_path_factory):
    path = tmp_path_factory.mktemp("smolvlm2")
    torch.manual_seed(0)
    config = transformers.SmolVLMConfig(vision_config=VISION, text_config=TEXT, image_token_id=IMAGE, scale_factor=2)
    model = transformers.SmolVLMForConditionalGeneration(config).eval()
    randomize(model)
    with torch.no_grad():  # logits of 0 for the image marks: never sampled
        model.lm_head.weight[IMAGE:] = 0.0
    model.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump({"image_processor_type": "SmolVLMImageProcessor", **PROCESSOR, "video_sampling": VIDEO_SAMPLING}, f)
    save_word_tokenizer(path, MARKS | WORDS, "<image>", video_text="<video>")  # (<video> not one of its tokens)
    return str(path), model


def test_number_words_as_num2words_writes_them():
    want = {0: "zero", 1: "one", 8: "eight", 13: "thirteen", 20: "twenty", 21: "twenty-one", 64: "sixty-four",
            100: "one hundred", 105: "one hundred and five", 999: "nine hundred and ninety-nine",
            1000: "one thousand", 1001: "one thousand and one", 2345: "two thousand, three hundred and forty-five"}
    assert {n: number_words(n) for n in want} == want
    with pytest.raises(ValueError, match="out of the range"):
        number_words(-1)


def test_frames_sampled_as_transformers_samples_them():
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor as HF
    from transformers.video_utils import VideoMetadata

    for total, rate, fps, most in [(10, 5.0, 2, 4), (300, 30.0, 1, 64), (300, 30.0, 1, 4), (500, 25.0, 2, 8),
                                   (7, 24.0, 1, 64), (90, 30.0, 0.5, 2)]:
        ours = SmolVLMVideoProcessor.from_dict({"video_sampling": {"fps": fps, "max_frames": most}}, 32)
        meta = VideoMetadata(total_num_frames=total, fps=rate, duration=total / rate)
        want = HF.sample_frames(types.SimpleNamespace(num_frames=most, fps=fps), meta)
        np.testing.assert_array_equal(ours.sampler(total, rate), want, err_msg=str((total, rate, fps, most)))


def test_a_videos_text_is_transformers():
    """The text a video stands as: `replace_video_token`'s (its number words from `number_words`: num2words is not
    installed here), tokenized as the engine lays it out."""
    from transformers.models.smolvlm import processing_smolvlm
    from transformers.video_utils import VideoMetadata

    fake = types.SimpleNamespace(image_seq_len=4, image_token="<image>", fake_image_token="<fake_token_around_image>",
                                 global_image_token="<global-img>")
    processing_smolvlm.num2words = number_words
    for total, rate, indices in [(10, 5.0, [0, 3, 6, 9]), (5000, 25.0, [25, 1700, 3400, 4975]), (3, None, [0, 1, 2])]:
        meta = VideoMetadata(total_num_frames=total, fps=rate, frames_indices=indices,
                             duration=None if rate is None else total / rate)
        want = processing_smolvlm.SmolVLMProcessor.replace_video_token(fake, {"video_metadata": [meta]}, 0)
        intro, times = video_intro(Video(np.zeros((len(indices), 2, 2, 3), np.uint8), rate, total, np.asarray(indices)))
        frame = "<fake_token_around_image><global-img>" + "<image>" * 4 + "<fake_token_around_image>"
        assert intro + "".join(t + frame for t in times) + "\n\n" == want


def test_a_video_beside_an_image_equals_transformers(smolvlm2):
    """A prompt with an image and a video (3 frames at 2 a second, given): the frames one-tile images, written after
    the introduction and their times; greedy tokens and logprobs are transformers' on that prompt with the image's
    tiles and the frames in prompt order, batched with an image-only prompt and again from the prefix cache."""
    path, model = smolvlm2
    eng = image_engine(path)
    video_id = eng.images.video_token_id
    assert video_id == TEXT["vocab_size"] and eng.tokenizer.encode("<video>") == [video_id]  # (added: one past)
    clip = np.random.default_rng(9).integers(0, 256, (3, 40, 24, 3), dtype=np.uint8)
    prepared = eng.images.prepare_video((clip, {"fps": 2.0}))
    assert prepared.pixels.shape == (3, 3, 32, 32)
    image = random_image(1, (90, 31))
    prompts = [text(5, 3) + [IMAGE] + text(6, 2) + [video_id] + text(7, 2), [IMAGE] + text(4, 6)]
    media = [{"image": [image], "video": [(clip, {"fps": 2.0})]}, {"image": [random_image(3, (20, 20))]}]
    intro, times = video_intro(Video(clip, 2.0, 3))
    frame = eng.tokenizer.encode("<fake_token_around_image> <global-img>") + [IMAGE] * 4 + [FAKE]
    written = eng.tokenizer.encode(intro) + [t for at in times for t in (*eng.tokenizer.encode(at), *frame)] \
        + eng.tokenizer.encode("\n\n")
    assert written.count(WORDS["three"]) == 1 and written.count(GLOBAL) == 3
    head, kw = hf_expanded(path, "SmolVLM", prompts[0][:4], [image])
    ids = head + prompts[0][4:6] + written + prompts[0][7:]
    pixels = torch.cat([kw["pixel_values"][0], torch.from_numpy(prepared.pixels)])[None]
    mask = torch.ones(pixels.shape[:2] + pixels.shape[3:], dtype=torch.bool)
    expected = [torch_greedy(lambda x: model(input_ids=torch.tensor([x]), pixel_values=pixels,
                                             pixel_attention_mask=mask).logits[0, -1], ids, NEW_TOKENS)]
    ids2, kw2 = hf_expanded(path, "SmolVLM", prompts[1], media[1]["image"])
    expected.append(torch_greedy(lambda x: model(input_ids=torch.tensor([x]), **kw2).logits[0, -1], ids2, NEW_TOKENS))
    assert_batched_then_cached(eng, prompts, media, expected, 48, params=GREEDY)
    eng.add_request("ids", prompts[0], GREEDY, multi_modal_data=media[0])
    assert drain(eng)["ids"].prompt_token_ids == ids
    eng.check_integrity()


def test_chat_with_a_video_file(smolvlm2, tmp_path):
    """`LLM.chat` with a `video_url` part naming a file (10 frames at 5 a second): sampled at 2 a second, so 4 frames
    (0, 3, 6, 9) of a 2-second video; the template's `<video>` becomes their text and tokens; the reply is the
    engine's for the file given with the template's prompt."""
    from jaxserve.llm import LLM
    from jaxserve.videos import load_video
    from tests.modelrun import run_images
    from tests.test_engine_qwen2_vl_video import mjpeg_video

    path, _ = smolvlm2
    clip = np.repeat(np.repeat(np.random.default_rng(3).integers(0, 256, (10, 5, 4, 3), dtype=np.uint8), 8, axis=1),
                     8, axis=2)
    url = mjpeg_video(tmp_path, clip, 5.0)
    processor = SmolVLMVideoProcessor.from_dict({"video_sampling": VIDEO_SAMPLING}, 32)
    video = load_video(url, None, processor.sampler)
    np.testing.assert_array_equal(video.frame_indices, [0, 3, 6, 9])
    llm = LLM(model=path, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=512, page_size=8,
              kv_cache_memory_bytes=2**21, dtype="float32", warmup=False, compile_cache_dir=None)
    message = {"role": "user", "content": [{"type": "text", "text": "t5"},
                                           {"type": "video_url", "video_url": {"url": url}}]}
    reply = llm.chat([message], GREEDY)[0]
    written = reply.prompt_token_ids
    assert [written.count(w) for w in (WORDS["four"], WORDS["0:00:02"], GLOBAL)] == [1, 1, 4]
    ids = llm.engine.tokenizer.encode("user : t5 <video> <eos> assistant :")
    assert llm.engine.images.video_token_id in ids
    want = run_images(image_engine(path), [ids], [{"video": [url]}], params=GREEDY)[0][0]
    assert list(reply.outputs[0].token_ids) == want
