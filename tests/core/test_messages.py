import warnings

from lightning_tfdebug.core.messages import PACK, pack_warning


class Noted(UserWarning):
    pass


def test_a_pack_warning_reads_as_the_pack_and_stays_filterable_by_category_and_module():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pack_warning("[TFD220] ERROR from LossAtInit", Noted)
        pack_warning("[TFD220] ERROR from LossAtInit", Noted)  # the pack de-duplicates itself: each call is shown
    assert [str(w.message) for w in caught] == ["[TFD220] ERROR from LossAtInit"] * 2
    assert caught[0].filename == PACK and caught[0].category is Noted
    shown = warnings.formatwarning(caught[0].message, Noted, caught[0].filename, caught[0].lineno)
    assert shown == "lightning_tfdebug: [TFD220] ERROR from LossAtInit\n"
    other = warnings.formatwarning("elsewhere", UserWarning, "x.py", 3)
    assert other.startswith("x.py:3: UserWarning: elsewhere")  # everyone else's warnings read as before
    for filters in (dict(category=Noted), dict(module=PACK)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warnings.filterwarnings("ignore", **filters)
            pack_warning("hidden", Noted)
        assert caught == []
