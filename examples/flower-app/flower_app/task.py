"""flower-app: a Flower / PyTorch app.

The model, training and evaluation are those of Flower's PyTorch template (``flwr new``). Only
the data differs: the template downloads CIFAR-10 from the Hugging Face Hub, which this offline
example replaces with Fashion-MNIST from local files, split so that the sites hold disjoint
classes (site ``i`` of ``n`` holds the classes ``c`` with ``c % n == i``).
"""

import torch
from torch.utils.data import DataLoader, TensorDataset

from fedfuse.data import load_dataset
from fedfuse.experiments.user_models import (  # noqa: F401  (the models Net may be)
    TemplateNet,
    torchvision_resnet18,
    torchvision_vit,
)

#: the model of Flower's PyTorch template (simple CNN adapted from 'PyTorch: A 60 Minute Blitz'),
#: for 28x28 grey images; fedfuse's plain-model experiments train the same network. To fuse
#: torchvision's ResNet-18 or a small VisionTransformer instead, set ``Net = torchvision_resnet18``
#: (or ``torchvision_vit``): nothing else changes.
Net = TemplateNet


def _normalise(images: torch.Tensor) -> torch.Tensor:
    """uint8 images to floats in [-1, 1], as the template's Normalize((0.5,), (0.5,))."""
    return (images.float() / 255.0 - 0.5) / 0.5


def _site_share(partition_id: int, num_partitions: int, max_samples: int = 0):
    train = load_dataset("fashion-mnist", "train")
    index = torch.nonzero(train.labels % num_partitions == partition_id).flatten()
    if max_samples > 0:
        index = index[torch.randperm(len(index), generator=torch.Generator().manual_seed(0))]
        index = index[:max_samples].sort().values
    return _normalise(train.images[index]), train.labels[index]


def load_data(partition_id: int, num_partitions: int, max_samples: int = 0):
    """Load the site's share of Fashion-MNIST: 80% to train on, 20% to test on."""
    images, labels = _site_share(partition_id, num_partitions, max_samples)
    split = int(0.8 * len(labels))
    trainloader = DataLoader(
        TensorDataset(images[:split], labels[:split]), batch_size=32, shuffle=True
    )
    testloader = DataLoader(TensorDataset(images[split:], labels[split:]), batch_size=32)
    return trainloader, testloader


def load_fusion_set(samples: int = 400):
    """The server's own small fusion set: ``samples`` training images of the even classes only
    (skewed, as the fusion sets of fedfuse's papers are; with 2 sites, site 0's classes)."""
    images, labels = _site_share(0, 2, samples)
    return DataLoader(TensorDataset(images, labels), batch_size=64)


def load_centralized_test(max_samples: int = 2000):
    """The server's test set: the first ``max_samples`` Fashion-MNIST test images."""
    test = load_dataset("fashion-mnist", "test")
    images, labels = _normalise(test.images[:max_samples]), test.labels[:max_samples]
    return DataLoader(TensorDataset(images, labels), batch_size=128)


def train(net, trainloader, epochs, lr, device):
    """Train the model on the training set."""
    net.to(device)  # move model to GPU if available
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for images, labels in trainloader:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    avg_trainloss = running_loss / (epochs * len(trainloader))
    return avg_trainloss


def test(net, testloader, device):
    """Validate the model on the test set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    net.eval()
    with torch.no_grad():
        for images, labels in testloader:
            images, labels = images.to(device), labels.to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    accuracy = correct / len(testloader.dataset)
    loss = loss / len(testloader)
    return loss, accuracy
