"""Every registered analysis (``analysis.core.registry``) in one streamed pass per input kind (``one_pass.profile``)
and the report that assembles its results with figures into one HTML page and one JSON (``build``): each section a
registered analysis' (its runner in ``sections``), laid out with the HTML kit (``html``). The report computes nothing
of its own."""
