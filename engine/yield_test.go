package engine

import "runtime"

// runtimeYield lets other goroutines run (used only by the bounded leak check).
func runtimeYield() { runtime.Gosched() }
