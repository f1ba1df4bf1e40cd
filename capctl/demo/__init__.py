"""``capctl demo`` orchestration (:mod:`capctl.demo.run`) and process helpers shared with the tests
(:mod:`capctl.demo.processes`)."""
