module github.com/spacehq/space

go 1.26.8
