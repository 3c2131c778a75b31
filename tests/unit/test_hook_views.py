"""A bucket's views for a communication hook's ``gradients()``: made once, counted among the
reducer's own tensors on the storage, so that the kept-gradient check stays quiet, and
forgotten when the storage or a slot's layout changes."""

from __future__ import annotations

import torch

from bucketddp.reducer.storage import Bucket, tensors_on


def _bucket() -> Bucket:
    params = [torch.zeros(3, 4), torch.zeros(5)]
    bucket = Bucket(torch.arange(20.0), 17, [0, 1], params)
    bucket.own_tensors = tensors_on(bucket.storage)  # as count_own_tensors at install
    return bucket


def test_views_are_made_once_and_count_as_own() -> None:
    bucket = _bucket()
    first = bucket.views_for_hook()
    assert [v.shape for v in first] == [(3, 4), (5,)]
    assert tensors_on(bucket.storage) == bucket.own_tensors  # nothing kept elsewhere
    second = bucket.views_for_hook()
    assert second is not first  # a list of the hook's own
    assert all(a is b for a, b in zip(first, second, strict=True))  # the same views
    del first, second
    assert tensors_on(bucket.storage) == bucket.own_tensors


def test_views_are_forgotten_with_the_storage_or_a_slot_layout() -> None:
    bucket = _bucket()
    bucket.views_for_hook()
    bucket.drop_hook_views()  # a slot changed layout
    assert bucket.hook_views is None
    assert tensors_on(bucket.storage) == bucket.own_tensors
    bucket.views_for_hook()
    bucket.rebind(bucket.storage.clone())  # moved: the caller recounts own_tensors
    assert bucket.hook_views is None
    views = bucket.views_for_hook()
    assert views[0].untyped_storage().data_ptr() == bucket.storage.untyped_storage().data_ptr()
