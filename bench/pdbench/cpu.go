package pdbench

import (
	"syscall"
	"time"
)

// processCPU returns this process's CPU time so far, user plus system (0 if unavailable).
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
