"""What a device and a link are, and how long work takes on them: data sheets, measured tables,
this machine's profile and links, answered in seconds (a GEMM, a memory pass, a collective).
Pure Python; the cost model (codesign.cost) composes plans from these answers."""
