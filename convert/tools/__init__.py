"""The conversion programs (layer 4: programs sit above the libraries they use): the bodies of
``convert/to_dartree.py`` (:mod:`~dartree.convert.tools.to_dartree`) and ``convert/from_dartree.py``
(:mod:`~dartree.convert.tools.from_dartree`); the library they call is :mod:`dartree.convert.importer` and
:mod:`dartree.convert.exporter`."""
