//go:build linux || darwin

package enginebench

import (
	"syscall"
	"time"
)

// cpuTime returns the CPU time (user and system) this process has used, and whether it could be
// read.
func cpuTime() (time.Duration, bool) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, false
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), true
}
