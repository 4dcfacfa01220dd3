"""Every analysis in one streamed pass per input kind (``one_pass.profile``) and the report that assembles its
results with figures into one HTML page and one JSON (``build``). The report computes nothing of its own."""
