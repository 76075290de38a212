package model

import "golang.org/x/sys/unix"

// pinThread restricts the calling OS thread (locked to its goroutine) to cpus; none leaves it
// as it is.
func pinThread(cpus []int) error {
	if len(cpus) == 0 {
		return nil
	}
	var set unix.CPUSet
	for _, c := range cpus {
		set.Set(c)
	}
	return unix.SchedSetaffinity(0, &set)
}
