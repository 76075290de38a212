//go:build !amd64 || purego

package kernel

func hasInt8Asm() bool { return false }

// defaultInt8Tile is the int8 tile kernel of this process: portable Go.
var defaultInt8Tile int8TileFunc = tileInt8Generic

// int8Tiles lists the int8 tile kernels usable here (for tests).
func int8Tiles() []int8TileFunc { return []int8TileFunc{tileInt8Generic} }

// quantizeGroups quantizes nothing here: the portable code quantizes every group.
func quantizeGroups(int8Acts, int, int, []float32) int { return 0 }
