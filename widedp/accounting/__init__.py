"""Privacy accounting: compose StepSpend records (RDP, PLD, the paper's Theorem 3)."""
