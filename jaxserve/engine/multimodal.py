"""Images in an engine's requests: placeholders expanded, images read and processed at admission and encoded when a
step first reaches them (`image_prompt`), their embeddings fed to the decoder in place of the placeholder tokens'
embeddings, step by step as the prompt's chunks run.

The prefix cache and the router's KV events key pages by token ids, and every placeholder of every image has the
same id: there an image's tokens are keyed instead by an id made from a hash of its processed pixels (negative, so
never a vocabulary token). Two prompts share cached pages over an image only when the images are the same.

Gemma 3 writes an image as "\n\n", `<start_of_image>`, its tokens, `<end_of_image>`, "\n\n" where the prompt has
`<start_of_image>`, and its language model lets an image's tokens attend to each other both ways: each step then
tells the attention every token's last visible key (`ModelInputs.last_key`), and the scheduler never ends a prefill
chunk inside an image (`Request.whole_spans`).
"""

from __future__ import annotations

import copy
import functools
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.engine.embedding_cache import EmbeddingCache
from jaxserve.engine.image_prompt import ImagePrompt
from jaxserve.engine.placeholders import expand_placeholders
from jaxserve.images import ImageError, ImageProcessor, load_image, pixels_digest
from jaxserve.models.vision import VisionConfig, VisionParams, encode_images, vision_tensors
from jaxserve.models.vision_anyres import anyres_tokens, pack_anyres
from jaxserve.videos import VideoRef


@dataclass(frozen=True)
class PreparedImage:
    """An image read and processed (the slow host work, done off the engine's thread by a server): its pixels as
    the tower takes them, its (height, width), and the hash the caches key it by."""

    pixels: np.ndarray
    size: tuple[int, int]
    digest: bytes


@dataclass(frozen=True)
class PreparedVideo(PreparedImage):
    """A video read and processed: its patches (`pixels`), its frames' (height, width) as given, the hash the caches
    key it by (of its patches and `time_step`), its patch grid (t, h, w), how far its M-RoPE temporal position
    moves from one temporal patch to the next (Qwen2.5-VL: by the seconds between them), and (Qwen3-VL) each
    temporal patch's time in seconds, written before it in the prompt; (SmolVLM2) the text written with it, its
    introduction and then each frame's time."""

    grid: tuple[int, int, int]
    time_step: float
    timestamps: tuple[float, ...] = ()
    texts: tuple[str, ...] = ()


def cache_key(digest: bytes) -> int:
    """An image's (or video's) id in the prefix cache: negative, so never a vocabulary token."""
    return -1 - int.from_bytes(digest[:4], "little") % (2**31 - 2)


class ImageEncoder:
    """An image-text model's vision side on the device: its processor, tower and projector."""

    video_frames: int | None = None  # `--media-io-kwargs` video num_frames: a video file's frames (None: as processed)
    placeholder_ids: tuple[int, ...] = ()  # placeholders past the model's vocabulary (SmolVLM2's added `<video>`)

    def __init__(self, cfg: VisionConfig, params: VisionParams, processor: ImageProcessor,
                 allowed_local_path: str | None = None, cache_bytes: int = 0, hf_config: dict | None = None,
                 unused: dict[str, np.ndarray] | None = None, tokenizer: Any = None):
        """`cache_bytes`: host memory for the embeddings of images seen before (least recently used go first);
        `hf_config`: the checkpoint's config.json and `unused` the tower's tensors the model does not read (on the
        host), both for `jaxserve convert` to write back; `tokenizer`: the model's (Gemma 3's newlines around an
        image are its tokens)."""
        self.cfg = cfg
        self.tokenizer = tokenizer
        self._newline_tokens: dict[int, int] = {}  # token -> the newlines it is (0: other text)
        self.hf_config = hf_config or {}
        self.unused = unused or {}
        self.params = params
        self.dtype = params.patch.dtype  # the model's: what the decoder takes
        self.processor = processor
        self.allowed_local_path = allowed_local_path
        self._encode = jax.jit(functools.partial(encode_images, cfg=cfg))
        self.cache = EmbeddingCache(cache_bytes)
        self.cache_queries = self.cache_hits = 0  # this encoder's lookups (an engine's), for its metrics

    def on(self, device: Any) -> ImageEncoder:
        """A copy of this encoder with its weights on `device`, sharing this one's embeddings cache (a data-parallel
        engine's replicas: images encoded ahead by one serve all)."""
        other = copy.copy(self)
        other.cache_queries = other.cache_hits = 0
        other.use_params(jax.device_put(self.params, device))
        return other

    def checkpoint_tensors(self, text: Iterable[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
        """The whole model's tensors as the Hub lays out LLaVA's and Gemma 3's (for `jaxserve convert`): the language
        model's (`text`, under their HF names) nested in `language_model.`, then the tower's and projector's."""
        return itertools.chain(((f"language_model.{n}", t) for n, t in text),
                               vision_tensors(self.params, self.cfg), self.unused.items())

    def use_params(self, params: VisionParams) -> None:
        """New weights; the embeddings of the old ones are forgotten."""
        self.params = params
        self.clear_cache()

    def clear_cache(self) -> None:
        """Forget the embeddings of the images seen before."""
        self.cache.clear()

    @property
    def processor_config(self) -> dict[str, Any]:
        return dict(self.processor.source or {})

    @property
    def image_token_id(self) -> int:
        return self.cfg.image_token_id

    @property
    def placeholder_token_id(self) -> int:
        """The token a prompt marks an image with: Gemma 3's `<start_of_image>`, else the image token."""
        return self.cfg.image_token_id if self.cfg.boi_token_id is None else self.cfg.boi_token_id

    def warmup(self) -> float:
        """Compile the encoder for one image (what every request's images run as); returns the seconds it took."""
        t0, size = time.perf_counter(), self.cfg.image_size
        jax.block_until_ready(self._encode(self.params, pixels=jnp.zeros((1, self.cfg.num_channels, size, size))))
        return time.perf_counter() - t0

    def views(self, image: PreparedImage) -> list[PreparedImage]:
        """The images the decoder sees of one image, each in its own span: the image, or Gemma 3's image and its pan
        and scan crops (each keyed by its own pixels: the first as the image would be without crops)."""
        if image.pixels.ndim != 4 or self.cfg.grid_pinpoints is not None:  # LLaVA-NeXT's crops make one image
            return [image]
        return [PreparedImage(p, image.size, pixels_digest(p, image.size)) for p in image.pixels]

    def num_tokens(self, image: PreparedImage) -> int:
        """The tokens an image (or a view of one) takes: fixed, or by its size for LLaVA-NeXT."""
        if self.cfg.grid_pinpoints is None:
            return self.cfg.tokens_per_image
        return anyres_tokens(self.cfg, image.size)

    def prepare(self, source: Any) -> PreparedImage:
        """An image from anything `load_image` reads (or prepared already), read and processed; a video (`VideoRef`)
        as `prepare_video` makes it."""
        if isinstance(source, PreparedImage):
            return source
        if isinstance(source, VideoRef):
            return self.prepare_video(source.source)
        image = load_image(source, self.allowed_local_path)
        pixels, size = self.pixels(image), image.size[::-1]  # PIL's size is (width, height)
        return PreparedImage(pixels, size, pixels_digest(pixels, size))

    def prepare_video(self, source: Any) -> PreparedVideo:
        """A video read and processed (an image-text model of video too overrides this)."""
        raise ValueError(f"this model ({type(self).__name__.removesuffix('ImageEncoder') or 'LLaVA'}'s vision tower) "
                         "takes images, not videos")

    def pixels(self, image: Any) -> np.ndarray:
        """One image (read) as the tower's normalized pixels: [C, S, S], or LLaVA-NeXT's crops [n, C, S, S], or an
        image cut by Gemma 3's pan and scan and its crops [1 + n, C, S, S]."""
        pixels = self.processor(image)
        want = (self.cfg.num_channels, self.cfg.image_size, self.cfg.image_size)
        ndims = (4,) if self.cfg.grid_pinpoints is not None else (3, 4) if self.processor.pan_and_scan else (3,)
        if pixels.shape[-3:] != want or pixels.ndim not in ndims:
            raise ImageError(f"the image processor made pixels of shape {pixels.shape}; the vision tower takes {want}")
        return pixels

    def prompt(self, ids: Sequence[int], images: Sequence[Any]) -> tuple[list[int], ImagePrompt]:
        """The prompt with each image's placeholder expanded to its tokens (a placeholder already expanded is kept),
        and its images (anything `prepare` takes) read, to be encoded as steps reach them. The prompt must hold one
        placeholder per image."""
        images = [self.prepare(image) for image in images]
        out, spans = self.layout(ids, images)
        views = [view for image in images for view in self.views(image)]
        return out, ImagePrompt(spans, [cache_key(view.digest) for view in views], self.cfg.bidirectional, views,
                                self._embeds)

    def layout(self, ids: Sequence[int], images: Sequence[PreparedImage]) -> tuple[list[int], list[tuple[int, int]]]:
        """The prompt with each (prepared) image's placeholder expanded to its tokens, and where each view of each
        image (`views`) has its tokens (first position, number)."""
        return self.expand(ids, [[self.num_tokens(view) for view in self.views(im)] for im in images])

    def expand(self, ids: Sequence[int], counts: Sequence[Sequence[int]]) -> tuple[list[int], list[tuple[int, int]]]:
        """`expand_placeholders` for this model, `counts` the tokens of each image's views. Gemma 3's placeholder is
        `<start_of_image>`, which becomes "\n\n", `<start_of_image>`, the image's tokens, `<end_of_image>`, "\n\n"
        as its processor writes them, newlines next to them merged into one token as the tokenizer reads a run of
        newlines (a prompt holding image tokens is taken as expanded); an image cut by pan and scan becomes its
        processor's sentence with that sequence for the image, then for each crop."""
        cfg = self.cfg
        if cfg.boi_token_id is None or cfg.image_token_id in ids:
            return expand_placeholders(ids, cfg.image_token_id, [n for views in counts for n in views])
        at = [i for i, t in enumerate(ids) if t == cfg.boi_token_id]
        if len(at) != len(counts):
            raise ValueError(f"the prompt has {len(at)} image placeholder(s) (token {cfg.boi_token_id}) for "
                             f"{len(counts)} image(s): put one placeholder where each image goes")
        out: list[int] = []
        spans: list[tuple[int, int]] = []
        prev = 0
        for i, views in zip(at, counts, strict=True):
            out.extend(ids[prev:i])
            if len(views) == 1:
                self._add_newlines(out, 2)
                out.append(cfg.boi_token_id)
                spans.append((len(out), views[0]))
                out.extend([cfg.image_token_id] * views[0] + [cfg.eoi_token_id])
            else:
                n = iter(views)
                for t in self._pan_and_scan_ids(len(views) - 1):
                    if t == cfg.image_token_id:
                        spans.append((len(out), next(n)))
                        out.extend([t] * spans[-1][1])
                    else:
                        out.append(t)
            prev = i + 1
            after = 2
            while prev < len(ids) and self._newlines(ids[prev]):  # newlines after the placeholder join these
                after += self._newlines(ids[prev])
                prev += 1
            self._add_newlines(out, after)
        out.extend(ids[prev:])
        return out, spans

    def _pan_and_scan_ids(self, crops: int) -> list[int]:
        """Gemma 3's processor's text for an image and its `crops`, one image token for each, up to the last
        `<end_of_image>` (the newlines after it join the prompt's)."""
        tok, cfg = self.tokenizer, self.cfg
        image = "\n\n" + "".join(tok.decode([t], skip_special_tokens=False)
                                  for t in (cfg.boi_token_id, cfg.image_token_id, cfg.eoi_token_id)) + "\n\n"
        text = (f"Here is the original image {image} and here are some crops to help you see better "
                + " ".join([image] * crops))
        return tok.encode(text.removesuffix("\n\n"))

    def _newlines(self, token: int) -> int:
        """How many newlines `token` is (0: a token of other text)."""
        if token not in self._newline_tokens:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            self._newline_tokens[token] = len(text) if text and set(text) == {"\n"} else 0
        return self._newline_tokens[token]

    def _add_newlines(self, out: list[int], count: int) -> None:
        """`count` newlines onto `out`, merged with the newline tokens it ends with."""
        if self.tokenizer is None:
            raise RuntimeError("Gemma 3's image layout needs the model's tokenizer (ImageEncoder(tokenizer=...))")
        while out and out[-1] >= 0 and self._newlines(out[-1]):
            count += self._newlines(out.pop())
        out.extend(self.tokenizer.encode("\n" * count))

    def encode_ahead(self, image: PreparedImage) -> None:
        """Encode an image into the cache from a thread other than the engine's (a server's, as the image arrives),
        so the engine's thread finds it there and its steps are not held up; nothing without a cache, or while the
        weights are off the device (the engine then refuses the request)."""
        if self.cache.limit_bytes <= 0:
            return
        try:
            for view in self.views(image):
                self._embeds(view, count=False)
        except RuntimeError:  # the weights were freed (sleep mode)
            pass

    def _embeds(self, image: PreparedImage, count: bool = True) -> np.ndarray:
        """An image's embeddings: from the cache when its pixels were seen before, else encoded (and cached)."""
        emb, generation = self.cache.get(image.digest)
        if count:  # the engine thread's lookups only (a server's thread encodes ahead without counting)
            self.cache_queries += 1
            self.cache_hits += emb is not None
        if emb is None:
            emb = self._encode_pixels(image)
            self.cache.put(image.digest, emb, generation)
        return emb

    def _encode_pixels(self, image: PreparedImage) -> np.ndarray:
        """One image's embeddings [tokens, E] from its pixels and its size before processing."""
        pixels, size = image.pixels, image.size
        if self.cfg.grid_pinpoints is None:
            return np.asarray(self._encode(self.params, pixels=jnp.asarray(pixels)[None])[0])
        # One crop at a time: one compiled encoder for any number of crops.
        feats = np.stack([np.asarray(self._encode(self.params, pixels=jnp.asarray(c)[None])[0]) for c in pixels])
        return pack_anyres(self.cfg, feats, np.asarray(self.params.newline), size)


@dataclass(frozen=True)
class ImageSpec:
    """What a front end needs of an image-text engine: its placeholder, the tokens an image takes, how images are
    read and processed, and how many a prompt may hold."""

    token_id: int
    placeholder: str  # the image token's text, as a chat template writes it
    layout: Callable[[Sequence[int], Sequence[PreparedImage]], tuple[list[int], list[tuple[int, int]]]]  # the encoder's
    prepare: Callable[[Any], PreparedImage]  # an image read and processed (`ImageEncoder.prepare`)
    encode_ahead: Callable[[PreparedImage], None]  # its embeddings into the engine's cache (`ImageEncoder`)
    limits: Mapping[str, int]  # most images ("image") and videos ("video") a prompt may hold
    video_placeholder: str | None = None  # the video token's text (a model of videos too)

    def expanded(self, ids: Sequence[int], images: Sequence[Any]) -> list[int]:
        """A rendered prompt with its (prepared) images' placeholders expanded."""
        return self.layout(ids, images)[0]

    def check_count(self, items: Sequence[Any]) -> None:
        check_media_counts(items, self.limits)

    def load(self, sources: Sequence[Any], encode: bool = True) -> list[PreparedImage]:
        """The images read (fetched, decoded), processed and (with `encode`, for a request that will run) encoded
        ahead: slow, so off the event loop and the engine's thread."""
        images = [self.prepare(source) for source in sources]
        for image in images if encode else ():
            self.encode_ahead(image)
        return images


def image_spec(engine: Any) -> ImageSpec | None:
    """An `LLMEngine`'s `ImageSpec`; None when it takes no images."""
    encoder = getattr(engine, "images", None)
    if encoder is None:
        return None
    token, video = encoder.placeholder_token_id, getattr(encoder, "video_token_id", None)
    # (without a tokenizer, `skip_tokenizer_init`, no placeholder text: prompts come as token ids)
    text = functools.partial(engine.tokenizer.decode, skip_special_tokens=False) if engine.tokenizer else lambda _: None
    return ImageSpec(token, text([token]), encoder.layout, encoder.prepare, encoder.encode_ahead,
                     engine.args.limit_mm_per_prompt or {},
                     text([video]) if video is not None and encoder.video_processor is not None else None)


def admit_images(engine: Any, ids: list[int], multi_modal_data: Any) -> tuple[list[int], ImagePrompt | None]:
    """A request's prompt with its images' placeholders expanded, and its images encoded (None: it has none), for an
    `LLMEngine`; an image attended both ways must fit in one prefill chunk."""
    images = images_of(multi_modal_data)
    if not images:
        return ids, None
    encoder, limits = engine.images, engine.args.limit_mm_per_prompt or {}
    if encoder is None:
        why = "its images are turned off (limit_mm_per_prompt image 0)" if limits.get("image") == 0 else \
            "it is a text model"
        raise ValueError(f"model {engine.model.name!r} takes no images: {why}")
    check_media_counts(images, limits)
    ids, prompt = encoder.prompt(ids, images)
    chunk = engine.scheduler.config.prefill_chunk_size
    longest = max((end - start for start, end in prompt.whole_spans), default=0)
    if longest > chunk:
        raise ValueError(f"an image of {longest} tokens does not fit in a prefill chunk of {chunk} "
                         "(max_num_batched_tokens, long_prefill_token_threshold): this model attends an image's "
                         "tokens to each other, so each image runs in one chunk")
    return ids, prompt


def request_fields(ids: list[int], images: ImagePrompt | None) -> dict[str, Any]:
    """A `Request`'s prompt as the prefix cache keys it, and the spans no prefill chunk may end inside."""
    if images is None:
        return {"prompt_token_ids": ids}
    return {"prompt_token_ids": images.cache_ids(ids), "whole_spans": images.whole_spans}


def prompt_cache_ids(engine: Any, ids: list[int], images: Sequence[Any] | None) -> list[int]:
    """A prompt (its placeholders expanded) as an `LLMEngine`'s prefix cache keys it: each image's tokens as its
    image's id (nothing encoded)."""
    if not images or engine.images is None:
        return list(ids)
    ids, prompt = engine.images.prompt(ids, images)
    return prompt.cache_ids(ids)


def check_media_counts(items: Sequence[Any], limits: Mapping[str, int]) -> None:
    """ValueError past the images' or the videos' limit per prompt (`items`: images and `VideoRef`s)."""
    videos = sum(isinstance(x, (VideoRef, PreparedVideo)) for x in items)
    for kind, count in (("image", len(items) - videos), ("video", videos)):
        limit = limits.get(kind)
        if limit is not None and count > limit:
            raise ValueError(f"{count} {kind}s exceed the limit of {limit} per prompt (limit_mm_per_prompt)")


def media_data(items: Sequence[Any]) -> dict[str, list[Any]]:
    """Images and videos in one list (a chat's parts in order: videos as `VideoRef`s) as `multi_modal_data`."""
    videos = [x.source if isinstance(x, VideoRef) else x for x in items if isinstance(x, (VideoRef, PreparedVideo))]
    images = [x for x in items if not isinstance(x, (VideoRef, PreparedVideo))]
    return {"image": images} | ({"video": videos} if videos else {})


def images_of(multi_modal_data: Any) -> list[Any]:
    """The images of vLLM's `multi_modal_data` ({"image": one image or a list}), then its videos ({"video": one
    video or a list}; each a `VideoRef`); others are refused by name."""
    if not multi_modal_data:
        return []
    if not isinstance(multi_modal_data, dict):
        raise ValueError(f"multi_modal_data must be a dict like {{'image': ...}}, got {type(multi_modal_data).__name__}")
    other = sorted(set(multi_modal_data) - {"image", "video"})
    if other:
        raise ValueError(f"multi_modal_data {other} is not supported: images and videos only ('image', 'video')")
    videos = multi_modal_data.get("video")
    one = videos is not None and not isinstance(videos, list)  # (a (frames, metadata) pair is one video)
    videos = [VideoRef(v) for v in ([videos] if one else videos or [])]
    images = multi_modal_data.get("image")
    images = list(images) if isinstance(images, (list, tuple)) else [] if images is None else [images]
    return images + videos
