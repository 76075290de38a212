package instance

import "github.com/kvbridge/kvbridge/internal/procmem"

// memoryFigures returns the machine's memory and this process's resident set, in bytes.
func memoryFigures() (total, resident int64, err error) {
	if total, err = procmem.Total(); err != nil {
		return 0, 0, err
	}
	if resident, err = procmem.Resident(); err != nil {
		return 0, 0, err
	}
	return total, resident, nil
}
