"""The vision-encoder balancer (spec 003 §1.3): an image goes to the encoder GPU with the fewest patches in flight,
patches = (width / patch_size) x (height / patch_size). Synthetic loads, no servers."""

from __future__ import annotations

import random

from openinfer.serving.balancers import EncoderGpu, EncoderLoads, image_patches


def test_patches_are_the_specs_grid():
    assert image_patches(672, 448, 14) == 48 * 32
    assert image_patches(13, 100, 14) == 0


def test_each_image_goes_to_the_gpu_with_the_fewest_patches_in_flight():
    loads = EncoderLoads([EncoderGpu("a", 0, 900), EncoderGpu("a", 1, 100), EncoderGpu("b", 0, 400)])
    first = loads.take(500)
    assert (first.url, first.gpu) == ("a", 1) and first.patches_in_flight == 600
    second = loads.take(50)                           # b:0 (400) is now the least loaded
    assert (second.url, second.gpu) == ("b", 0)
    loads.give_back(first, 500)
    assert loads.take(10) is first                    # back to 100 in flight


def test_a_stream_of_random_images_keeps_the_gpus_within_one_image_of_each_other():
    """Greedy fewest-patches over a stream with nothing finishing: the spread never exceeds the largest image."""
    rng = random.Random(0)
    loads = EncoderLoads([EncoderGpu(u, g) for u in "abc" for g in range(2)])
    largest = 0
    for _ in range(500):
        patches = image_patches(rng.randint(200, 2000), rng.randint(200, 2000), 14)
        largest = max(largest, patches)
        loads.take(patches)
        inflight = [g.patches_in_flight for g in loads.gpus]
        assert max(inflight) - min(inflight) <= largest


def test_an_unhealthy_instance_gets_nothing_until_it_is_back():
    loads = EncoderLoads([EncoderGpu("a", 0), EncoderGpu("b", 0, 5000)])
    loads.mark("a", False)
    assert loads.take(10).url == "b"
    loads.mark("b", False)
    assert loads.take(10) is None
    loads.mark("a", True)
    assert loads.take(10).url == "a"


def test_other_clients_images_count_once_the_instance_reports_them():
    """Several prefill instances share the encoders: a GPU's load is the larger of its last report (every client's
    images) and this client's own count since."""
    loads = EncoderLoads([EncoderGpu("a", 0), EncoderGpu("b", 0)])
    loads.mark("a", True, reported_patches=3000)          # another prefill instance keeps `a` busy
    assert loads.take(100).url == "b"
    assert loads.take(100).url == "b"                     # b: 200 of its own, still below a's 3000
    loads.mark("b", True, reported_patches=150)           # a report older than our last image: ours count
    assert loads.gpus[1].load == 200
    loads.mark("a", True, reported_patches=0)
    assert loads.take(100).url == "a"


def test_a_retry_skips_the_instances_already_tried():
    loads = EncoderLoads([EncoderGpu("a", 0), EncoderGpu("b", 0, 500)])
    first = loads.take(10)
    assert first.url == "a"
    loads.give_back(first, 10)                            # the call failed
    assert loads.take(10, exclude={"a"}).url == "b"
    assert loads.take(10, exclude={"a", "b"}) is None     # none left: the prefill side encodes the image itself


def test_load_reports_the_patches_of_image_spans_not_computed_yet():
    """/load's `image_patches_in_flight`: the patches of every image whose span a request has not computed yet."""
    from types import SimpleNamespace as NS

    import torch

    from openinfer.multimodal import ImageSpan
    from openinfer.serving.load import BusyMeter, engine_load

    def image(offset, grid):
        return ImageSpan.make(offset, (0, 3), torch.zeros(grid[0] * grid[1], 3, 2, 2), grid)

    reqs = {"a": NS(num_computed_tokens=0, num_prompt_tokens=40, images=(image(2, (4, 5)), image(30, (2, 2)))),
            "b": NS(num_computed_tokens=35, num_prompt_tokens=40, images=(image(2, (3, 3)), image(34, (6, 6)))),
            "c": NS(num_computed_tokens=10, num_prompt_tokens=10, images=())}
    engine = NS(scheduler=object(), requests=reqs, config=NS(block_size=16), max_model_len=128,
                stats=lambda: {"kv_blocks_total": 8, "kv_blocks_free": 4, "num_running": 3},
                kv_store_namespace=lambda: None)
    load = engine_load(engine, NS(num_waiting=0), "both", "m", BusyMeter())
    assert load["image_patches_in_flight"] == 20 + 4 + 36       # b has computed its first span, not its second
