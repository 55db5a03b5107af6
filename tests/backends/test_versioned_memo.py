"""The version-keyed memo (flexc/backends/versioned_memo.py): a value is served again for the same
tensors, and for other tensor objects over the same elements (a compiled backward's saved aliases),
never after an in-place write through any of them, never for other elements of the same storage,
and never once its tensors were freed."""
import gc

import torch

from flexc.backends.versioned_memo import VersionedMemo


def _counting_memo():
    memo, builds = VersionedMemo(8), []

    def get(*tensors):
        return memo.get(tensors, "key", lambda: builds.append(1) or len(builds))
    return get, builds


def test_an_alias_of_the_same_elements_finds_the_value_and_a_write_through_it_does_not():
    get, builds = _counting_memo()
    t = torch.arange(12).view(3, 4)
    assert get(t) == 1 and get(t) == 1
    alias = t.detach()  # a new tensor object over the same elements, sharing the version counter
    assert alias is not t and get(alias) == 1
    assert get(t.view(3, 4)) == 1
    alias[0, 0] = 5  # written through the alias: t's version moves too
    assert get(t) == 2 and get(alias) == 2
    assert len(builds) == 2


def test_other_elements_of_the_same_storage_are_other_tensors():
    get, _ = _counting_memo()
    base = torch.arange(12)
    first, second, strided = base[:6], base[6:], base[::2]
    assert get(first) == 1
    assert get(second) == 2  # same storage, another offset
    assert get(strided) == 3  # same storage and offset, other strides
    assert get(first.view(2, 3)) == 4  # same elements, another shape: another key (only costs a build)
    assert get(first) == 1


def test_a_freed_tensor_is_never_served_to_a_new_one_at_its_address():
    get, builds = _counting_memo()
    for _ in range(20):  # new tensors of one shape: the allocator reuses the freed memory
        t = torch.zeros(64)
        get(t)
        del t
        gc.collect()
    assert len(builds) == 20


def test_inference_tensors_are_built_every_time():
    get, builds = _counting_memo()
    with torch.inference_mode():
        t = torch.zeros(4)
    get(t), get(t)
    assert len(builds) == 2


def test_the_same_object_given_other_elements_without_a_version_bump_is_built_again():
    """``.data = new`` (no version bump), ``.data = <another view of its own storage>``, ``set_``
    and a storage freed and reused under the same object: each is asked for again."""
    get, builds = _counting_memo()
    t = torch.arange(12.0)
    version = t._version
    assert get(t) == 1 and get(t) == 1
    t.data = torch.arange(12.0) + 1  # another storage
    assert t._version == version and get(t) == 2
    t.data = t.data[2:]  # the same storage, another offset and shape
    assert get(t) == 3
    t.data = t.data.view(2, 5)  # the same elements, another shape
    assert get(t) == 4
    t.data = t.data.view(torch.int32)  # the same bytes, another dtype
    assert get(t) == 5
    for _ in range(10):  # new storages of one size: the allocator reuses freed memory
        t.data = torch.zeros(12)
        get(t)
    assert len(builds) == 15
    with torch.no_grad():
        t.set_(torch.ones(12))
    assert get(t) == 16
